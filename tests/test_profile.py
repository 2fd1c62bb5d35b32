"""``bench --profile``: the decode-step split (engine/bench/profile.py), by counts and
invariants."""

from __future__ import annotations

import pytest

from engine.bench.profile import KINDS, SCOPES, format_profile, profile_decode
from engine.hardware.cpu_paths import cpu_paths
from engine.kernels import decode_step
from engine.kernels.packed_linear import PackedLinear
from engine.loader.load import load_model


@pytest.mark.parametrize(("precision", "pack"), [("fp32", True), ("fp32", False), ("int8", True)])
def test_every_matmul_and_attention_of_a_step_lands_in_its_scope(tiny_model_dir, precision, pack):
    folder, _ = tiny_model_dir("llama", False)
    engine = load_model(folder, precision=precision, pack=pack)
    packed = any(isinstance(m, PackedLinear) for m in engine.model.modules())
    # the float linears (all at fp32; at int8 the bf16 head) take the probed layout
    assert packed == (pack and cpu_paths().packed(engine.dtype).ok)
    layers = engine.cfg.num_layers
    with decode_step.eager():  # the modules' split (the C step's: below)
        p = profile_decode(engine, list(range(5, 25)), steps=6)
    calls = p.calls
    # per decode step: qkv + o per layer, gate_up + down per layer, one LM head
    assert calls["attention block"]["matmul"] == pytest.approx(2 * layers)
    assert calls["mlp"]["matmul"] == pytest.approx(2 * layers)
    assert calls["lm_head"]["matmul"] == pytest.approx(1)
    assert calls["attention"]["attention"] > 0 and calls["attention"]["matmul"] == 0
    assert calls["norms"]["matmul"] == 0 and calls["engine"]["matmul"] == 0
    # the kinds share out the profiled wall time, nothing negative
    total = sum(p.kind_total(k) for k in KINDS)
    assert total == pytest.approx(p.profiled_step_ms, rel=0.02)
    assert all(v >= 0 for row in p.ms.values() for v in row.values())
    assert p.step_ms > 0
    # the engine is left as it was: no hooks, its own attention context, no request
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in engine.model.modules())
    assert engine.kv.manager.num_free == engine.kv.manager.num_blocks and not engine.has_work()
    text = format_profile(p, "tiny")
    assert all(s in text for s in ("attention block", "mlp", "lm_head", "python/dispatch"))
    assert set(p.as_dict()["ms_per_step"]) == set(SCOPES)


def test_bench_profile_cli(tiny_model_dir, capsys):
    import json

    from app.cli.main import main

    folder, _ = tiny_model_dir("llama", False)
    argv = ["bench", "--profile", "--model", str(folder), "--new-tokens", "4",
            "--prompt-len", "8", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 4 and out["step_ms"] > 0
    assert out["calls_per_step"]["lm_head"]["matmul"] == pytest.approx(1)
    assert main(argv[:-1]) == 0
    assert "python/dispatch" in capsys.readouterr().out


def test_our_c_kernels_are_counted_where_they_run(tiny_model_dir):
    """With our CPU kernels (``INFERSIGHT_LOWBIT=ours``), whose ctypes calls the profiler does
    not see by itself: the products are recorded as matmuls in their scopes, and the step runs
    as it does unprofiled, the fused RoPE + K/V write included (once per layer and step)."""
    import dataclasses

    from engine.kernels import lowbit, native

    if native.compiler() is None:
        pytest.skip("no C compiler: our CPU kernels are not built here")
    folder, _ = tiny_model_dir("llama", False, hidden_size=128, intermediate_size=256)
    with lowbit.choosing("ours"):
        engine = load_model(folder, precision="int8")
    rope_store = engine.model.ops.rope_store
    assert rope_store is not None
    stores: list[int] = []

    def counted(*args, **kwargs):
        stores.append(args[0].shape[0])
        return rope_store(*args, **kwargs)

    engine.model.set_ops(dataclasses.replace(engine.model.ops, rope_store=counted))
    layers, steps = engine.cfg.num_layers, 4
    with decode_step.eager():
        p = profile_decode(engine, list(range(5, 25)), steps=steps)
    assert p.calls["attention block"]["matmul"] == pytest.approx(2 * layers)
    assert p.calls["mlp"]["matmul"] == pytest.approx(2 * layers)
    assert p.calls["lm_head"]["matmul"] == pytest.approx(1)
    assert p.calls["attention"]["attention"] > 0
    # the prefill, then the unprofiled and the profiled steps: each layer rotated and stored
    assert len(stores) == layers * (1 + 2 * steps)
    assert not native.RECORDING  # the recording ends with the profile


def test_the_c_decode_step_splits_its_own_time(tiny_model_dir):
    """Where a decode step runs in one C call (:mod:`engine.executor.c_step`), the profile
    splits that call by the step's own clocks: four products per layer and the LM head as
    matmuls, one attention per layer, the loops between them as other ops; the kinds still
    share out the wall time, and nothing runs through the modules' scopes."""
    from engine.kernels import lowbit, native

    if native.compiler() is None:
        pytest.skip("no C compiler: our CPU kernels are not built here")
    folder, _ = tiny_model_dir("llama", False, intermediate_size=128)
    with lowbit.choosing("ours"):
        engine = load_model(folder, precision="int8")
    assert engine.runner.executor.c_step is not None, engine.kernels
    layers, steps = engine.cfg.num_layers, 5
    p = profile_decode(engine, list(range(5, 25)), steps=steps)
    row = p.ms["C decode step"]
    assert p.calls["C decode step"]["matmul"] == pytest.approx(4 * layers)
    assert p.calls["C decode step"]["attention"] == pytest.approx(layers)
    assert row["matmul"] > 0 and row["attention"] > 0 and row["other ops"] > 0
    for scope in ("attention block", "attention", "mlp", "lm_head"):
        assert not any(p.ms[scope].values()), scope
    total = sum(p.kind_total(k) for k in KINDS)
    assert total == pytest.approx(p.profiled_step_ms, rel=0.02)
    assert all(v >= 0 for r in p.ms.values() for v in r.values())
    assert 0 < p.outside < 1
    # unprofiled, by the step's clocks: its kernels are part of its wall time
    assert p.clocked_ms is not None and 0 < p.clocked_ms < p.step_ms
    assert p.outside_unprofiled == pytest.approx(1 - p.clocked_ms / p.step_ms)
    assert "outside matrix products and attention" in format_profile(p, "tiny")
