"""The C decode step (``engine/kernels/decode_step.py``, ``infersight_decode_step`` in
``csrc/layer_ops.c``): every layer of a decode step, and the LM head, in one call. It gives
the eager step's tokens and logits, and wherever it does not apply the eager step runs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from engine.core.sampling import SamplingParams
from engine.kernels import decode_step, gemv, lowbit, native
from engine.loader.load import load_model

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")

#: the tiny models' MLP a multiple of INT4's group, so that every linear runs our kernels
WIDE = {"intermediate_size": 128}
PRECISIONS = ["fp32", "bf16", "int8", "int4-g32"]


def _ours(folder, precision: str, **kwargs):
    """A load whose layers all take our CPU kernels (``INFERSIGHT_LOWBIT=ours``)."""
    with lowbit.choosing("ours"):
        return load_model(folder, precision=precision, **kwargs)


@contextmanager
def _counting(engine) -> Iterator[list[bool]]:
    """The C step's calls while inside: True where it ran the step, False where it declined."""
    calls: list[bool] = []
    step = engine.runner.executor.c_step
    assert step is not None, engine.kernels

    class Counted:  # the step, its calls counted
        def __getattr__(self, name: str):
            return getattr(step, name)

        def __call__(self, *args):
            out = step(*args)
            calls.append(out is not None)
            return out

    engine.runner.executor.c_step = Counted()
    try:
        yield calls
    finally:
        engine.runner.executor.c_step = step


def _generate(engine, prompts: list[list[int]], steps: int, **params) -> tuple[list, list]:
    """Greedy tokens of each prompt, decoded together, and the logits of every step."""
    logits: list[torch.Tensor] = []
    forward = engine.runner.forward

    def recording(batch, kv):
        out = forward(batch, kv)
        logits.append(out.clone())
        return out

    engine.clear_prefix_cache()
    engine.runner.forward = recording
    try:
        sampling = SamplingParams(max_new_tokens=steps, ignore_eos=True, **params)
        rids = [engine.add_request(p, sampling) for p in prompts]
        tokens: dict[str, list[int]] = {rid: [] for rid in rids}
        while engine.has_work():
            for event in engine.step():
                if event.token_id is not None:
                    tokens[event.request_id].append(event.token_id)
    finally:
        engine.runner.forward = forward
    return [tokens[rid] for rid in rids], logits


PROMPTS = [list(range(5, 18)), list(range(40, 44)), list(range(100, 129))]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("llama", False),
                                            ("qwen2", False), ("mistral", False)])  # fmt: skip
def test_the_c_step_gives_the_eager_steps_tokens_and_logits(tiny_model_dir, arch, tied,
                                                            precision):  # fmt: skip
    """Three sequences of different lengths decoding together (their keys masked to their
    own lengths), Qwen2's biases, Mistral's sliding window (8, far exceeded): the C step runs
    every decode step and gives the eager step's tokens; its logits agree to fp32's rounding
    in fp32 (SiLU's exp is libm's, not torch's: an ulp of fp32 apart; 8e-7 measured) and to
    a bf16 rounding where the activations are bf16 (equal to the bit on these models, as
    measured: every other part runs the eager step's kernels and roundings)."""
    folder, _ = tiny_model_dir(arch, tied, **WIDE)
    engine = _ours(folder, precision)
    assert engine.kernels.endswith("decode steps in one C call"), engine.kernels
    with _counting(engine) as calls:
        ours, ours_logits = _generate(engine, PROMPTS, 12)
    assert len(calls) == 11 and all(calls)  # every step after the prefill
    with decode_step.eager():
        eager, eager_logits = _generate(engine, PROMPTS, 12)
    assert ours == eager
    for got, want in zip(ours_logits, eager_logits, strict=True):
        if engine.dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # one bf16 place at the logits' scale (|logit| < 4)
            torch.testing.assert_close(got, want, rtol=0, atol=2**-6)


def test_a_cache_window_with_a_sink_reads_what_the_eager_step_reads(tiny_model_dir):
    """A cache window of 8 tokens after a sink of 4, decoding far past it: the mask the C
    step passes its attention hides what the window gave back, as the eager step's does."""
    from engine.core.config import EngineConfig
    from engine.kv_cache.window import CacheWindow

    folder, _ = tiny_model_dir("llama", False, **WIDE)
    config = EngineConfig(window=CacheWindow(4, 8), block_size=4)
    engine = _ours(folder, "fp32", config=config)
    with _counting(engine) as calls:
        ours, ours_logits = _generate(engine, PROMPTS[:2], 20)
    assert all(calls) and len(calls) == 19
    with decode_step.eager():
        eager, eager_logits = _generate(engine, PROMPTS[:2], 20)
    assert ours == eager
    torch.testing.assert_close(torch.cat(ours_logits), torch.cat(eager_logits),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_the_eager_step_runs_where_the_c_step_does_not_apply(tiny_model_dir):
    """Prefill steps never reach it; more sequences than our kernels take rows are declined;
    a reason to run eagerly (a benchmark's eager row) keeps every step eager."""
    from engine.core.config import EngineConfig
    from engine.core.scheduler import SchedulerLimits

    folder, _ = tiny_model_dir("llama", False, **WIDE)
    config = EngineConfig(limits=SchedulerLimits(max_batch_size=gemv.MAX_ROWS + 1))
    engine = _ours(folder, "fp32", config=config)
    many = [[5 + i, 9, 11] for i in range(gemv.MAX_ROWS + 1)]
    with _counting(engine) as calls:
        _generate(engine, many, 3)
    # the prefill never reaches it; the two decode steps of 17 rows are declined
    assert calls == [False, False]
    engine.runner.executor.eager_reasons.add("bench: eager row")
    try:
        with _counting(engine) as calls:
            _generate(engine, PROMPTS[:1], 4)
        assert calls == []
    finally:
        engine.runner.executor.eager_reasons.discard("bench: eager row")
    with _counting(engine) as calls:
        _generate(engine, PROMPTS[:1], 4)
    assert calls == [True] * 3


def test_why_a_load_keeps_the_eager_step(tiny_model_dir):
    folder, _ = tiny_model_dir("qwen3", False, **WIDE)
    engine = _ours(folder, "fp32")
    assert engine.runner.executor.c_step is None
    assert "decode steps eager (per-head q/k norms" in engine.kernels
    folder, _ = tiny_model_dir("llama", False, **WIDE)
    with lowbit.choosing("torch"):
        engine = load_model(folder, precision="int8")
    assert engine.runner.executor.c_step is None
    assert f"decode steps eager ({lowbit.ENV}=torch)" in engine.kernels


def test_a_failing_c_step_hands_this_and_every_later_step_to_the_eager_code(tiny_model_dir, caplog):
    """A kernel that fails inside the call (here: out of memory) costs nothing but the
    speed: the step runs again eagerly, from its embedding, and so does every later one."""
    folder, _ = tiny_model_dir("llama", False, **WIDE)
    engine = _ours(folder, "fp32")
    with decode_step.eager():
        want, _ = _generate(engine, PROMPTS, 6)
    step = engine.runner.executor.c_step
    assert step is not None
    step.fn = lambda *args: -1
    with caplog.at_level(logging.WARNING):
        got, _ = _generate(engine, PROMPTS, 6)
    assert got == want
    assert engine.runner.executor.c_step is None
    assert "the C decode step failed, running eagerly" in caplog.text


def test_engines_sharing_the_model_each_read_and_write_their_own_pool(tiny_model_dir):
    """Two engines on one model (the A/B lab's siblings), their decode steps interleaved, and
    an engine whose pool was swapped for a new one: each gives the tokens it gives alone."""
    folder, _ = tiny_model_dir("llama", False, **WIDE)
    engine = _ours(folder, "fp32")
    want, _ = _generate(engine, PROMPTS, 8)
    with lowbit.choosing("ours"):  # as the load was (the tests' default is torch's kernels)
        other = engine.sibling(engine.config)
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)
    got: dict[str, list[int]] = {}
    rids = [(e, e.add_request(p, sampling)) for p in PROMPTS for e in (engine, other)]
    with _counting(other) as calls:
        while engine.has_work() or other.has_work():
            for e in (engine, other):
                for event in e.step():
                    if event.token_id is not None:
                        got.setdefault(event.request_id, []).append(event.token_id)
    assert sum(calls) >= 2 * 7  # both engines' decode steps ran in C (the model's one plan)
    for e in (engine, other):
        assert [got[rid] for owner, rid in rids if owner is e] == want
    with lowbit.choosing("ours"):
        resized = engine.with_pool(num_blocks=engine.kv.manager.num_blocks + 8)
    assert resized.runner.executor.c_step is not None
    assert _generate(resized, PROMPTS, 8)[0] == want


def test_layer_timings_come_from_the_c_step_itself(tiny_model_dir):
    """With layer timings on, decode steps still run in C, and each layer's attention block
    and MLP are timed there (the prefill by the modules' hooks); the tokens are the same.
    Off again, nothing is timed."""
    folder, _ = tiny_model_dir("llama", False, **WIDE)
    engine = _ours(folder, "fp32")
    want, _ = _generate(engine, PROMPTS, 6)
    engine.enable_layer_timing(True)
    seen: list[tuple] = []
    collect = engine.collect_layer_timings

    def collecting() -> None:
        collect()
        seen.append(engine.layer_timings)

    engine.collect_layer_timings = collecting
    try:
        with _counting(engine) as calls:
            got, _ = _generate(engine, PROMPTS, 6)
    finally:
        engine.enable_layer_timing(False)
    assert got == want and calls == [True] * 5
    decode_steps = seen[-5:]  # after the prefill's, each decode step's from the C step
    for timings in decode_steps:
        assert [t.layer for t in timings] == list(range(engine.cfg.num_layers))
        assert all(t.attention_s > 0 and t.mlp_s > 0 for t in timings)
    step = engine.runner.executor.c_step
    assert step is not None and not step.times_layers and step.take_layer_seconds() == []


def test_the_step_is_checked_before_a_load_uses_it(tiny_model_dir, monkeypatch):
    """The check (run in a child process by the load, once per set of builds) passes here,
    with the C step running its decode step; a check that fails keeps the eager step and
    says why."""
    from engine.executor import c_step_check as decode_check
    from engine.hardware import isolated

    assert decode_check.check() == ""

    asked: list[str] = []
    verdict = isolated.verdict

    def failing(name: str, target: str, key: str, **kwargs: object) -> str:
        if target != decode_check.PROBE:  # the kernels' own checks, as they are
            return verdict(name, target, key, **kwargs)  # type: ignore[arg-type]
        asked.append(target)
        return "it crashed"

    monkeypatch.setattr(isolated, "verdict", failing)
    folder, _ = tiny_model_dir("llama", False, **WIDE)
    engine = _ours(folder, "fp32")
    assert asked == [decode_check.PROBE]
    assert engine.runner.executor.c_step is None
    assert "decode steps eager (the C step failed its check: it crashed)" in engine.kernels
