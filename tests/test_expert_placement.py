"""``--cpu-experts N|auto``: the plan of a mixture of experts with the experts of its first N
layers in host memory, for the published configs on a 12 GiB card."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from engine.core.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.loader import expert_placement
from engine.loader.memory_plan import plan_memory
from engine.model.config import ModelConfig
from engine.quant.sizes import CPU
from engine.quant.spec import parse_precision_spec
from engine.store.synthetic_store import CONFIGS

GiB = 2**30


def published(name: str) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((CONFIGS / f"{name}.json").read_text()))


def plan(cfg: ModelConfig, precision: str, cpu_experts: int | str):
    config = EngineConfig(cpu_experts=cpu_experts)
    return plan_memory(cfg, precision, "cuda", memory=12 * GiB, config=config, name="m")


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
@pytest.mark.parametrize("precision", ["int4-g32", "int4-g128+head"])
def test_auto_keeps_the_fewest_layers_experts_on_the_cpu_that_leave_4k_of_context(name, precision):
    cfg = published(name)
    whole = plan(cfg, precision, 0)
    assert not whole.fits  # the reason for the option: on 12 GiB the experts do not fit
    auto = plan(cfg, precision, "auto")
    count = len(auto.cpu_expert_layers)
    assert auto.fits and auto.max_context >= expert_placement.AUTO_CONTEXT
    assert auto.cpu_expert_layers == tuple(range(count))  # the first layers of experts
    one_fewer = plan(cfg, precision, count - 1)
    assert one_fewer.max_context < expert_placement.AUTO_CONTEXT or not one_fewer.fits
    # what left the device is the experts of those layers, and they are in host memory
    spec = parse_precision_spec(precision, "meta")
    moved = whole.weights["mlp"] - auto.weights["mlp"]
    assert moved == expert_placement.experts_bytes(
        cfg, spec, auto.cpu_expert_layers, expert_placement.Backends(triton=True)
    )
    assert auto.host_expert_bytes == expert_placement.experts_bytes(
        cfg, spec, auto.cpu_expert_layers, CPU
    )
    assert {k: v for k, v in auto.weights.items() if k != "mlp"} == {
        k: v for k, v in whole.weights.items() if k != "mlp"
    }


def test_a_count_of_layers_is_checked_against_the_model():
    moe, dense = published("qwen3-30b-a3b"), published("gemma-3-12b")
    assert len(plan(moe, "int4-g32", 48).cpu_expert_layers) == 48  # every layer of experts
    with pytest.raises(InvalidRequestError, match="this model has 48 layers of experts"):
        plan(moe, "int4-g32", 49)
    with pytest.raises(InvalidRequestError, match="this model has none"):
        plan(dense, "int4-g32", 2)
    assert plan(dense, "int4-g32", "auto").cpu_expert_layers == ()  # nothing to move
    for bad in ("many", "-1"):
        with pytest.raises(InvalidRequestError, match="--cpu-experts takes"):
            expert_placement.parse(bad)
    with pytest.raises(InvalidRequestError, match="cpu_experts must be"):
        EngineConfig(cpu_experts=-2)
    assert expert_placement.parse("AUTO") == "auto" and expert_placement.parse("12") == 12


def test_the_plan_command_says_where_the_experts_go():
    config = CONFIGS / "qwen3-30b-a3b.json"
    args = ["plan", "--model", str(config), "--device", "cuda", "--memory", "12GiB"]
    out = subprocess.run(
        [sys.executable, "-m", "app.cli.main", *args, "--precision", "int4-g32",
         "--cpu-experts", "auto"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    layers = len(plan(published("qwen3-30b-a3b"), "int4-g32", "auto").cpu_expert_layers)
    assert re.search(rf"experts on the CPU .*the experts of {layers} layers", out.stdout)
    assert re.search(r"verdict\s+fits", out.stdout)


@pytest.mark.parametrize(
    ("arch", "precision"),
    [("qwen3_moe", "fp32"), ("qwen2_moe", "fp32"), ("qwen3_moe", "int4-g32")],
)
def test_a_load_checks_its_count_and_experts_run_where_they_are_placed(
    tiny_model_dir, arch, precision
):
    """On a CPU both sides are the CPU: a load keeps every expert where the rest is, after
    checking the count against the model; experts marked as living in host memory (as a
    GPU load marks the layers it kept there) give the same logits, each layer's rows, chosen
    experts and weights crossing once (:mod:`engine.model.host_crossing`), the shared expert
    (Qwen2-MoE's) run beside them, quantized experts on their own kernel (one C call a
    decode row)."""
    import torch

    from engine.loader.load import load_model
    from engine.model.moe import MoE

    folder, _ = tiny_model_dir(arch, False)  # Qwen3-MoE: layers 0 and 2 of experts, 1 dense
    count = len(expert_placement.expert_layers(ModelConfig.from_file(folder / "config.json")))
    with pytest.raises(InvalidRequestError, match=f"this model has {count} layers of experts"):
        load_model(folder, precision=precision, config=EngineConfig(cpu_experts=count + 1))
    engine = load_model(folder, precision=precision, config=EngineConfig(cpu_experts=count))
    moes = [layer.mlp for layer in engine.model.layers if isinstance(layer.mlp, MoE)]
    assert len(moes) == count
    assert all(m.expert_device is None and m.crossing is None for m in moes)
    assert (moes[0].shared is not None) == (arch == "qwen2_moe")
    ids = list(range(3, 30))
    prompt_ids, decode = ids[:-1], ids[-1:]

    def logits():
        cache = engine.runner.new_cache(len(ids))
        prompt = engine.runner.forward_logits(prompt_ids, cache, 0)
        return prompt, engine.runner.forward_logits(decode, cache, len(prompt_ids))

    before = logits()
    for moe in moes:
        moe.keep_on_host(torch.device("cpu"))
    assert all(m.crossing is not None for m in moes)
    after = logits()
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))


def test_on_a_cpu_nothing_moves_and_the_plan_counts_every_expert():
    """Host memory is a CPU's device: a plan for a CPU keeps every expert in its weights,
    whatever --cpu-experts says, and still checks the count against the model."""
    cfg = published("qwen3-30b-a3b")

    def cpu(cpu_experts):
        config = EngineConfig(cpu_experts=cpu_experts)
        return plan_memory(cfg, "int4-g32", "cpu", memory=24 * GiB, config=config, name="m")

    whole = cpu(0)
    for asked in (12, "auto"):
        placed = cpu(asked)
        assert placed.cpu_expert_layers == () and placed.weights == whole.weights
    with pytest.raises(InvalidRequestError, match="this model has 48 layers of experts"):
        cpu(49)
