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


def test_a_load_checks_its_count_and_experts_run_where_they_are_placed(tiny_model_dir):
    """On a CPU both sides are the CPU: a load keeps every expert where the rest is, after
    checking the count against the model; experts marked as living on the CPU (as a GPU
    load marks the layers it kept in host memory) give the same logits, their rows sent
    there and back."""
    import torch

    from engine.loader.load import load_model
    from engine.model.moe import MoE

    folder, _ = tiny_model_dir("qwen3_moe", False)  # layers 0 and 2 of experts, 1 dense
    with pytest.raises(InvalidRequestError, match="this model has 2 layers of experts"):
        load_model(folder, precision="fp32", config=EngineConfig(cpu_experts=3))
    engine = load_model(folder, precision="fp32", config=EngineConfig(cpu_experts=2))
    ids = list(range(3, 30))
    before = engine.runner.forward_logits(ids, engine.runner.new_cache(len(ids)), 0)
    moes = [layer.mlp for layer in engine.model.layers if isinstance(layer.mlp, MoE)]
    assert len(moes) == 2 and all(m.expert_device is None for m in moes)
    for moe in moes:
        moe.expert_device = torch.device("cpu")
    after = engine.runner.forward_logits(ids, engine.runner.new_cache(len(ids)), 0)
    assert torch.equal(before, after)


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
