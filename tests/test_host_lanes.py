"""Decode steps of a model whose experts live in host memory, in two lanes
(:mod:`engine.model.lanes`): the same tokens as one lane, every step of several rows split,
and the host's calls ordered so that while it runs one lane's experts, what the GPU was given
last is the other lane's work. On a CPU both sides are the CPU (the crossing moves nothing),
which is how the schedule is tested here; what it saves is a GPU's to measure (the GPU
check's ``figures.moe.host``)."""

from __future__ import annotations

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.sampling import SamplingParams
from engine.loader.load import load_model
from engine.model.moe import MoE
from engine.model.transformer import DecoderLayer
from tests.test_triton_engine import generate

PROMPTS = [[5, 17, 33, 8], [9, 9, 41, 2, 77, 3, 12], [100, 4, 4], [7, 70, 7]]
NEW = 6


def hosted(engine) -> list[MoE]:
    moes = [layer.mlp for layer in engine.model.layers if isinstance(layer.mlp, MoE)]
    for moe in moes:
        moe.keep_on_host(torch.device("cpu"))  # as a GPU load marks the layers it keeps there
    return moes


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_two_lanes_give_one_lanes_tokens(tiny_model_dir, arch):
    folder, _ = tiny_model_dir(arch, False)
    engine = load_model(folder, precision="fp32", config=EngineConfig(decode_graph="off"))
    want = generate(engine, PROMPTS, steps=NEW)
    assert engine.model.laned_steps == 0 and "two_lane_decode_steps" not in engine.paths()
    hosted(engine)
    assert generate(engine, PROMPTS, steps=NEW) == want
    paths = engine.paths()
    # every decode step of two rows or more: the four prompts' NEW - 1 steps, as they end
    assert paths["two_lane_decode_steps"] == engine.model.laned_steps >= NEW - 1
    assert all(row["experts"].endswith("(in host memory)") for row in paths["layers"]
               if "experts" in row)  # fmt: skip


def test_the_host_runs_a_lanes_experts_while_the_other_lanes_work_is_queued(
    tiny_model_dir, monkeypatch
):
    """The host's calls, in order: each lane's experts are finished (the CPU's work) right
    after the other lane's work was queued (what the GPU runs meanwhile), but for the last
    lane of the step's last layer, after which nothing is left to queue."""
    folder, _ = tiny_model_dir("qwen3_moe", False)  # layers 0 and 2 of experts, 1 dense
    engine = load_model(folder, precision="fp32", config=EngineConfig(decode_graph="off"))
    moes = hosted(engine)
    calls: list[tuple[str, object]] = []  # ("queued", a lane's context or lane) / ("experts", lane)
    real_attend, real_begin, real_finish = DecoderLayer.attend, MoE.begin, MoE.finish

    def attend(self, x, cos, sin, ctx):
        calls.append(("queued", ctx))
        return real_attend(self, x, cos, sin, ctx)

    def begin(self, x, lane=0):
        calls.append(("queued", lane))
        return real_begin(self, x, lane)

    def finish(self, pending):
        calls.append(("experts", pending.lane))
        return real_finish(self, pending)

    monkeypatch.setattr(DecoderLayer, "attend", attend)
    monkeypatch.setattr(MoE, "begin", begin)
    monkeypatch.setattr(MoE, "finish", finish)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    for prompt in PROMPTS:
        engine.add_request(prompt, params)
    laned = 0
    while engine.has_work():
        before = engine.model.laned_steps
        calls.clear()
        engine.step()
        if engine.model.laned_steps == before:
            continue
        laned += 1
        contexts = list(dict.fromkeys(c for what, c in calls if not isinstance(c, int)))
        assert len(contexts) == 2  # the lanes' own: lane 0's attends first
        lanes = [(what, c if isinstance(c, int) else contexts.index(c)) for what, c in calls]
        experts = [i for i, (what, _) in enumerate(lanes) if what == "experts"]
        assert len(experts) == 2 * len(moes)  # each lane's, each layer of experts
        for i in experts[:-1]:
            last = next(c for c in reversed(lanes[:i]) if c[0] == "queued")
            assert last[1] != lanes[i][1], lanes
    assert laned >= NEW - 1
