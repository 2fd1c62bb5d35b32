"""Every pair of the executors' compatibility table (engine/executor/table.py), run: each
decode-step executor asked for over each attention backend, on one tiny model. A pair the
table allows must run every decode step on that executor, as the paths report counts them
(``LLMEngine.paths``), and give the plain engine's tokens; a pair it refuses must say the
table's reason in the report and run its decode steps eagerly. A silent fallback fails here.

TorchInductor itself is not what is tested: the compiled executor's graph is the identity
(its compile is tested in test_decode_graph.py), so its routing runs in seconds."""

from __future__ import annotations

import pytest

from engine.core.config import EngineConfig
from engine.executor import inductor, table
from engine.kernels import lowbit, native, paged_decode
from engine.loader.load import load_model
from tests.conftest import WIDE_HEADS
from tests.test_triton_engine import generate

NEW = 5
PROMPTS = [[5, 17, 33, 8], [9, 9, 41, 2, 77, 3, 12], [100, 4, 4]]
#: heads our Triton kernels take, an MLP our GEMV takes whole
SHAPES = {**WIDE_HEADS, "intermediate_size": 128}
PAIRS = [(e, b) for e in table.EXECUTORS for b in table.BACKENDS]


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama", False, **SHAPES)[0]


@pytest.fixture(scope="module")
def want(folder):
    """The plain engine's greedy tokens: eager steps, this CPU's attention."""
    with lowbit.choosing("torch"):
        engine = load_model(folder, config=EngineConfig(decode_graph="off", cuda_graphs="off"))
    return generate(engine, PROMPTS, steps=NEW)


def force_backend(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """Attention on ``backend`` for the loads that follow (the kernels' own switches)."""
    monkeypatch.setenv("INFERSIGHT_KERNELS", "triton" if backend == "triton" else "torch")
    monkeypatch.setenv(paged_decode.ENV, "gather" if backend == "torch" else "auto")
    paged_decode.kernel.cache_clear()
    if backend != "torch" and not paged_decode.kernel().available and backend == "c":
        pytest.skip(f"no paged C kernel here: {paged_decode.kernel().why}")


@pytest.fixture(autouse=True)
def _kernels_as_they_were():
    """The paged kernel as this process had it, once the test's environment is undone (the
    kernel built and loaded again now, not inside a later test's measurement)."""
    yield
    paged_decode.kernel.cache_clear()
    paged_decode.kernel()


@pytest.mark.parametrize(("executor", "backend"), PAIRS, ids=[f"{e}-{b}" for e, b in PAIRS])
def test_each_pair_runs_what_the_table_says_and_the_report_shows_it(
    folder, want, monkeypatch, executor, backend
):
    force_backend(monkeypatch, backend)
    if executor == "c-step" and native.compiler() is None:
        pytest.skip("no C compiler: no C step")
    monkeypatch.setattr(inductor, "compiler_problem", lambda _device: "")
    monkeypatch.setattr(inductor, "compile_forward", lambda forward: forward)
    config = EngineConfig(
        decode_graph="on" if executor == "compiled" else "off",
        cuda_graphs="on" if executor == "cuda-graphs" else "off",
    )
    with lowbit.choosing("ours" if executor == "c-step" else "torch"):
        engine = load_model(folder, config=config)
        got = generate(engine, PROMPTS, steps=NEW)
    paths = engine.paths()
    assert paths["attention"]["backend"] == backend
    row = {r["executor"]: r for r in paths["executors"]}[executor]
    refused = table.refusal(executor, backend)
    decode = paths["steps"]["decode"]
    ran = "eager" if refused else executor
    assert decode == {ran: NEW - 1}  # every decode step, on the one executor
    assert paths["steps"]["prefill"] == {"eager": 1}
    assert row["settled"] is not refused and (not refused or row["why"] == refused)
    assert [r["executor"] for r in paths["executors"] if r["settled"]] == sorted(
        {ran, "eager"}, key=table.EXECUTORS.index
    )
    assert paths["fallbacks"] == []
    assert got == want
    products = {k for layer in paths["layers"] for k, v in layer.items() if "GEMV" in str(v)}
    if executor == "c-step" and not refused:  # every product on our GEMV, the head too
        assert products == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
        assert "GEMV" in paths["lm_head"]


def test_a_refusal_names_the_pair_and_its_reason():
    assert table.refusal("eager", "torch") == ""
    assert table.refusal("cuda-graphs", "c").startswith("cuda-graphs refused with c attention: ")
    assert "tensor parallelism" in table.refusal("c-step", "c", tensor_parallel=True)
    assert table.refusal("eager", "triton", tensor_parallel=True) == ""
    with pytest.raises(ValueError, match="no executor"):
        table.refusal("warp", "c")
    assert len(table.rows()) == len(PAIRS)


def test_an_executor_dropped_mid_run_is_a_fallback_in_the_report(folder, want, monkeypatch):
    """The compiled step that breaks at its first decode step: the step and every later one
    run eagerly, with the same tokens, and the report says what was dropped and why."""
    force_backend(monkeypatch, "c" if paged_decode.kernel().available else "torch")
    monkeypatch.setattr(inductor, "compiler_problem", lambda _device: "")
    monkeypatch.setattr(inductor, "compile_forward", lambda forward: forward)
    with lowbit.choosing("torch"):
        engine = load_model(folder, config=EngineConfig(decode_graph="on", cuda_graphs="off"))

    def breaks(*args):
        raise RuntimeError("an Inductor failure\nits traceback")

    engine.runner.executor.compiled = breaks
    assert generate(engine, PROMPTS, steps=NEW) == want
    paths = engine.paths()
    assert paths["steps"]["decode"] == {"eager": NEW - 1}
    assert paths["fallbacks"] == ["compiled dropped: RuntimeError: an Inductor failure"]


@pytest.mark.parametrize("lowbit_kernels", ["ours", "torch"])
def test_a_dropped_engine_frees_its_model_at_once(folder, monkeypatch, lowbit_kernels):
    """The model holds its executor and the executor its C step: neither holds the model
    back, so its weights go with the last reference, not at the cyclic collector's next run
    (the app switches models on a 12 GB card)."""
    import gc
    import weakref

    force_backend(monkeypatch, "c" if paged_decode.kernel().available else "torch")
    with lowbit.choosing(lowbit_kernels):
        engine = load_model(folder, config=EngineConfig(decode_graph="off", cuda_graphs="off"))
    generate(engine, PROMPTS[:1], steps=3)
    if lowbit_kernels == "ours" and native.compiler() is not None:
        assert engine.runner.executor.c_step is not None
    model = weakref.ref(engine.model)
    gc.disable()
    try:
        del engine
        assert model() is None
    finally:
        gc.enable()


def test_the_table_and_the_backends_agree_on_what_a_graph_may_capture():
    """A backend's ``graph_safe`` is the table's CUDA-graphs column: one statement each."""
    from engine.attention import PagedBackend, TritonBackend

    for backend, names in ((TritonBackend(), ["triton"]), (PagedBackend(), ["c", "torch"])):
        for name in names:
            assert backend.graph_safe is (table.refusal("cuda-graphs", name) == "")


def test_the_architecture_page_shows_the_table_as_it_is():
    """docs/architecture.md's table of pairs is the table's own verdicts."""
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    header = "| executor \\ attention | " + " | ".join(table.BACKENDS) + " |"
    rows = [
        f"| {e} | " + " | ".join("refused" if table.refusal(e, b) else "runs" for b in
                                 table.BACKENDS) + " |"
        for e in table.EXECUTORS
    ]  # fmt: skip
    assert "\n".join([header, "|---|---|---|---|", *rows]) in page
