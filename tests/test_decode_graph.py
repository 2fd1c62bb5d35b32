"""The compiled decode step (engine/executor/inductor.py): how the mode is settled, that a
compiled step gives transformers' greedy ids and batch invariance, and every way back to
eager."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.errors import InvalidRequestError
from engine.executor import inductor, table
from engine.executor.inductor import GraphChoice, choose
from engine.loader.load import load_model

STEPS = 24
CPU = torch.device("cpu")


def test_off_and_auto_on_an_unmeasured_kind_stay_eager(monkeypatch):
    assert choose("off", CPU) == GraphChoice(False, "off as asked")
    monkeypatch.setattr(inductor, "FASTER_COMPILED", frozenset())
    monkeypatch.setattr(inductor, "EAGER_MEASURED", frozenset())
    auto = choose("auto", CPU)
    assert not auto.compiled and auto.why.startswith("not yet measured on cpu/")
    monkeypatch.setattr(inductor, "EAGER_MEASURED", frozenset({inductor.device_kind(CPU)}))
    assert "compiling costs more at load than it saves" in choose("auto", CPU).why


def test_auto_compiles_where_measured_faster(monkeypatch):
    monkeypatch.setattr(inductor, "FASTER_COMPILED", frozenset({inductor.device_kind(CPU)}))
    monkeypatch.setattr(inductor, "compiler_problem", lambda _device: "")
    assert choose("auto", CPU).compiled


def test_on_without_a_compiler_says_why_and_stays_eager(monkeypatch):
    monkeypatch.setattr(inductor, "compiler_problem", lambda _device: "no C++ compiler found")
    choice = choose("on", CPU)
    assert not choice.compiled
    assert "no C++ compiler found" in choice.summary()


def test_triton_attention_and_tensor_parallelism_are_settled_in_choose_without_the_probe(
    monkeypatch,
):
    """The one place that says whether a step compiles: what the load does and what
    gpu-check expects both come from ``choose``, which asks no compiler probe (a child
    process of 20–60 s on a GPU) for a step that will not compile."""

    def probe(_device: str) -> str:
        raise AssertionError("the compiler probe ran for a step that cannot compile")

    monkeypatch.setattr(inductor, "compiler_problem", probe)
    for mode in ("on", "auto"):
        triton = choose(mode, CPU, backend="triton")
        under = table.refusal("compiled", "triton")
        assert under.startswith("compiled refused with triton attention")
        assert triton == GraphChoice(False, f"eager: {under}")
        split = choose(mode, CPU, tensor_parallel=True)
        parallel = table.refusal("compiled", "torch", tensor_parallel=True)
        assert (
            split == GraphChoice(False, f"eager: {parallel}") and "tensor parallelism" in parallel
        )
    assert choose("off", CPU, backend="triton").why == "off as asked"


def test_the_environment_sets_the_mode_and_bad_modes_are_refused(monkeypatch):
    monkeypatch.setenv(inductor.ENV, "off")
    assert inductor.requested_mode(None) == "off"
    assert inductor.requested_mode("on") == "on"  # the argument wins
    with pytest.raises(InvalidRequestError, match="auto, on, off"):
        EngineConfig(decode_graph="fast")


def _counting(engine: LLMEngine) -> list[int]:
    """Count the calls that reach the compiled graph."""
    calls = [0]
    compiled = engine.runner.executor.compiled
    assert compiled is not None

    def counted(*args: Any) -> torch.Tensor:
        calls[0] += 1
        return compiled(*args)

    engine.runner.executor.compiled = counted
    return calls


@pytest.fixture(scope="module")
def compiled_llama(tiny_model_dir) -> tuple[LLMEngine, Any]:
    # Two layers: a step still goes from layer to layer, each over its own cache; a third
    # would only add nodes for TorchInductor to generate code for (about 4 s a layer, cold).
    folder, hf = tiny_model_dir("llama", True, num_hidden_layers=2)
    problem = inductor.compiler_problem("cpu")
    if problem.startswith("the probe"):  # it crashed, or died: a fault to fix, never a skip
        pytest.fail(f"the compile probe {problem} (delete probes.json once it is fixed)")
    if problem:  # the probe's own answer: no compiler here, or Inductor cannot build with it
        pytest.skip(f"this machine cannot compile: {problem}")
    engine = load_model(folder, config=EngineConfig(decode_graph="on", num_blocks=64))
    assert engine.graph.compiled, engine.graph.why  # where the probe compiles, so must the step
    return engine, hf


def _hf_greedy(hf: Any, prompt: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 13, 29)]


def test_compiled_decode_gives_transformers_greedy_ids(compiled_llama):
    engine, hf = compiled_llama
    calls = _counting(engine)
    params = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    for prompt in _prompts(hf.config.vocab_size):
        ours = [e.token_id for e in engine.generate(prompt, params) if e.token_id is not None]
        assert ours == _hf_greedy(hf, prompt, STEPS)
    assert calls[0] == 3 * (STEPS - 1)  # every decode step ran compiled, prefill eager


def test_compiled_batches_give_what_each_request_gives_alone(compiled_llama):
    engine, hf = compiled_llama
    calls = _counting(engine)
    params = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    prompts = _prompts(hf.config.vocab_size)
    ids = [engine.add_request(p, params) for p in prompts]  # ragged: a padded, masked batch
    together: dict[str, list[int]] = {rid: [] for rid in ids}
    decode_only = 0
    context = engine.kv.context
    while engine.has_work():
        ctx = context  # count the steps that take the compiled path

        def counted(chunks, ctx=ctx):
            nonlocal decode_only
            made = ctx(chunks)
            decode_only += made.decode_only
            return made

        engine.kv.context = counted
        for event in engine.step():
            if event.token_id is not None:
                together[event.request_id].append(event.token_id)
    engine.kv.context = context
    assert decode_only >= STEPS - 1 and calls[0] == decode_only
    for prompt, rid in zip(prompts, ids, strict=True):
        assert together[rid] == _hf_greedy(hf, prompt, STEPS)


def test_shapes_no_graph_covers_run_eagerly_instead_of_compiling(compiled_llama):
    from torch._dynamo.utils import counters

    engine, hf = compiled_llama
    calls = _counting(engine)
    graphs = counters["stats"]["unique_graphs"]
    prompt = [7]  # its first decode step has one key: a size Inductor specialises
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ours = [e.token_id for e in engine.generate(prompt, params) if e.token_id is not None]
    assert ours == _hf_greedy(hf, prompt, 6)
    # the one-token prompt is itself a decode-shaped step: six steps, none compiled anew
    assert calls[0] == 6 and counters["stats"]["unique_graphs"] == graphs


def test_a_graph_that_fails_mid_reply_hands_over_to_eager(tiny_model_dir):
    folder, hf = tiny_model_dir("llama", True)
    engine = load_model(folder, config=EngineConfig(decode_graph="off", num_blocks=16))
    calls = [0]

    def breaks(*args: Any) -> torch.Tensor:
        calls[0] += 1
        raise RuntimeError("a kernel fell over")

    engine.runner.executor.compiled = breaks
    prompt = _prompts(hf.config.vocab_size)[0]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ours = [e.token_id for e in engine.generate(prompt, params) if e.token_id is not None]
    assert ours == _hf_greedy(hf, prompt, 6)
    assert calls[0] == 1 and engine.runner.executor.compiled is None


def test_layer_timings_run_every_step_eagerly(compiled_llama):
    engine, hf = compiled_llama
    calls = _counting(engine)
    engine.enable_layer_timing(True)
    try:
        prompt = _prompts(hf.config.vocab_size)[0]
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        ours = [e.token_id for e in engine.generate(prompt, params)]
        assert calls[0] == 0
        assert engine.metrics().layer_timings  # the hooks saw every layer
    finally:
        engine.enable_layer_timing(False)
    again = [e.token_id for e in engine.generate(prompt, params)]
    assert calls[0] == 3 and again == ours


def test_a_failed_compile_leaves_a_working_eager_engine(tiny_model_dir, monkeypatch):
    folder, hf = tiny_model_dir("qwen2", False)

    def broken(forward: Callable[..., Any]) -> Callable[..., Any]:
        def fails(*args: Any) -> torch.Tensor:
            raise RuntimeError("inductor fell over\nsecond line")

        return fails

    monkeypatch.setattr(inductor, "compiler_problem", lambda _device: "")
    monkeypatch.setattr(inductor, "compile_forward", broken)
    engine = load_model(folder, config=EngineConfig(decode_graph="on", num_blocks=16))
    assert not engine.graph.compiled
    assert engine.graph.why == "compiling failed (inductor fell over); eager"
    assert engine.runner.executor.compiled is None
    assert engine.kv.manager.num_free == 16  # the warm-up's blocks are back
    prompt = _prompts(hf.config.vocab_size)[1]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    assert [e.token_id for e in engine.generate(prompt, params)] == _hf_greedy(hf, prompt, 8)


def test_the_reason_is_the_line_that_says_what_went_wrong():
    wrapped = RuntimeError("backend='inductor' raised:\nCppCompileError: C++ compile error\n\nmore")
    assert inductor.reason(wrapped) == "CppCompileError: C++ compile error"
    assert inductor.reason(RuntimeError("")) == "RuntimeError"
