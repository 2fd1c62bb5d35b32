"""The A/B lab end to end: a real view, the lab's thread, real engines
(app/gui/lab.py, app/gui/lab_worker.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtCore import Qt

from app.cli.main import main
from app.gui.lab import LabController
from app.gui.lab_worker import free_memory
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.evals.compare import compare_prompt
from engine.evals.compare_file import read_document
from engine.evals.sides import Side
from engine.loader.load import load_model
from tests.app_window import SHARED_WEIGHTS, Recorder
from tests.probed import needs_int4
from widgets.ab_view import ABView

pytestmark = pytest.mark.usefixtures("gui_gc")

TINY_PROMPT = "t1 t7 t3 t9 t2"
REAL_PROMPT = "Name three uses of a paperclip."
LONG_WAIT_MS = 240_000


def form(model: str, a: str, b: str, prompt: str, tokens: int, **extra: Any) -> dict[str, Any]:
    side = {"model": model, "temperature": 0.0, "window": None}
    return {
        "a": {**side, "precision": a},
        "b": {**side, "precision": b},
        "seed": 0,
        "max_new_tokens": tokens,
        "prompt": prompt,
        "continue_conversation": False,
        **extra,
    }


class Lab:
    """A view and its controller, with what the view was sent recorded."""

    def __init__(
        self, qtbot: Any, available: Any = free_memory, messages: Any = None, loader: Any = None
    ) -> None:
        self.view = ABView()
        qtbot.addWidget(self.view)
        extra = {"loader": loader} if loader else {}
        self.controller = LabController(
            self.view, messages or (lambda: []), available=available, **extra
        )
        self.appends: dict[str, list[str]] = {"a": [], "b": []}
        self.notices: list[str] = []
        # received in the UI thread, as the window's lab takes them: a server's side streams
        # from a thread of its own, whose emissions a plain callable would not get in order
        self._streamed = Recorder(self._record)
        self.controller.worker.deltas.connect(self._streamed.record)
        self.controller.worker.notice.connect(lambda text, _level: self.notices.append(text))
        self.controller.worker.failed.connect(self.notices.append)
        self.qtbot = qtbot

    def _record(self, deltas: list[tuple[str, str]]) -> None:
        for side, text in deltas:
            self.appends[side].append(text)

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        self.controller.run(request)
        self.qtbot.waitUntil(lambda: not self.controller.busy, timeout=LONG_WAIT_MS)
        report = self.view.report()
        assert report is not None, self.notices
        return report

    def close(self) -> None:
        self.controller.shutdown()


@pytest.fixture
def tiny(tiny_model_dir: Any) -> Path:
    folder, _ = tiny_model_dir("llama", False)
    return folder


@needs_int4
def test_an_ab_on_a_tiny_model_equals_the_engines_own_comparison(qtbot, tiny, tmp_path):
    lab = Lab(qtbot)
    try:
        report = lab.run(form(str(tiny), "fp32", "int4-g32", TINY_PROMPT, 12))
    finally:
        lab.close()
    a = load_model(tiny, precision="fp32")
    b = load_model(tiny, precision="int4-g32")
    greedy = Side(SamplingParams(max_new_tokens=12, seed=0))
    direct = compare_prompt(a, b, TINY_PROMPT, greedy, greedy)
    for key in ("a", "b"):
        assert report[key]["token_ids"] == direct[key]["token_ids"]
        assert report["columns"][key]["kl"] == pytest.approx(direct["columns"][key]["kl"], abs=1e-9)
        assert lab.view.column_text(key) == direct[key]["text"]
    assert report["divergence"] == direct["divergence"]
    assert report["memory"]["mode"] == "side by side"
    # speculative decoding measured as the engine measures it, shown beside the prediction
    measured, expected = (r["summary"]["speculative"]["measured"] for r in (report, direct))
    assert measured["matches_a"] is True
    for key in ("token_acceptance", "accepted_tokens", "draft_tokens", "acceptance_per_pos"):
        assert measured[key] == expected[key], key
    assert ", measured " in lab.view.summary_text()


@needs_int4
def test_the_same_weights_on_torchs_kernels_and_ours_side_by_side(qtbot, tiny_model_dir):
    """A at int4-g32 on torch's kernels, B at int4-g32 on ours (their int8 activations): two
    engines, each side's layers on the kernels its form asked for, and the KL between them
    what quantizing the activations alone costs: small, and not nothing."""
    from engine.kernels import native

    if native.compiler() is None:
        pytest.skip("no C compiler: our low-bit kernels are not built here")
    folder, _ = tiny_model_dir("llama", True, hidden_size=128, intermediate_size=256)
    lab = Lab(qtbot)
    try:
        request = form(str(folder), "int4-g32", "int4-g32", TINY_PROMPT, 8)
        request["a"]["lowbit"], request["b"]["lowbit"] = "torch", "ours"
        report = lab.run(request)
        engines = lab.controller.worker._engines
        kernels = {key[3]: {m.kernel for m in e.model.modules() if hasattr(m, "quantized")}
                   for key, e in engines.items()}  # fmt: skip
    finally:
        lab.close()
    assert set(kernels) == {"torch", "ours"}
    assert not any(k.startswith("our int8-activation kernel") for k in kernels["torch"])
    assert len(kernels["ours"]) == 1
    assert next(iter(kernels["ours"])).startswith("our int8-activation kernel")
    assert 0 < report["summary"]["kl_mean"] < 0.05
    assert "our low-bit kernels" in lab.view.columns["b"].header.text()


def test_an_int8_kv_cache_against_the_float_one_on_the_same_weights(qtbot, tiny):
    """B at A's precision with an int8 KV cache: one copy of the weights behind two pools,
    B's figures what the engine's own comparison of the two caches gives, its header and
    stats naming its cache."""
    from engine.core.config import EngineConfig

    lab = Lab(qtbot)
    try:
        request = form(str(tiny), "fp32", "fp32", TINY_PROMPT, 12)
        request["b"]["kv_dtype"] = "int8"
        report = lab.run(request)
        (engine,) = lab.controller.worker._engines.values()  # the weights loaded once
        assert "KV int8" in lab.view.columns["b"].header.text()
    finally:
        lab.close()
    assert engine.config.kv_dtype == "auto"
    assert (report["a"]["kv_dtype"], report["b"]["kv_dtype"]) == ("fp32", "int8")
    a = load_model(tiny, precision="fp32", config=EngineConfig(num_blocks=64))
    b = a.sibling(EngineConfig(num_blocks=64, kv_dtype="int8"))
    greedy = Side(SamplingParams(max_new_tokens=12, seed=0))
    direct = compare_prompt(a, b, TINY_PROMPT, greedy, greedy)
    for key in ("a", "b"):
        assert report[key]["token_ids"] == direct[key]["token_ids"]
        assert report["columns"][key]["kl"] == pytest.approx(direct["columns"][key]["kl"], abs=1e-9)
    assert 0 < report["summary"]["kl_mean"] < 0.05


def test_when_a_and_b_do_not_fit_they_run_one_after_the_other(qtbot, tiny):
    together = Lab(qtbot)
    # 200 kB free: room for the score tables (2 × 6 × 10 tokens × 320 × 4 bytes = 154 kB), not
    # for A and B (the fp32 weights alone are over 500 kB)
    apart = Lab(qtbot, available=lambda _device: 200_000.0)
    try:
        request = form(str(tiny), "fp32", "int8", TINY_PROMPT, 10)
        one = together.run(request)
        two = apart.run(request)
    finally:
        together.close()
        apart.close()
    assert two["memory"]["mode"] == "one after the other"
    assert any("do not fit side by side" in n and "missing" in n for n in apart.notices)
    assert two["a"]["token_ids"] == one["a"]["token_ids"]
    assert two["b"]["token_ids"] == one["b"]["token_ids"]
    assert two["summary"]["kl_mean"] == pytest.approx(one["summary"]["kl_mean"], abs=1e-12)
    assert two["summary"]["noise_kl_mean"] == pytest.approx(one["summary"]["noise_kl_mean"])
    # B drafts for A only when both are loaded: not measured, and why
    assert "measured" in one["summary"]["speculative"]
    assert "do not fit" in two["summary"]["speculative"]["not_measured"]


def test_save_open_and_bad_files(qtbot, tiny, tmp_path):
    lab = Lab(qtbot)
    try:
        report = lab.run(form(str(tiny), "fp32", "int8", TINY_PROMPT, 6))
        path = tmp_path / "ab.json"
        lab.controller.save_json(str(path))
        saved = read_document(json.loads(path.read_text(encoding="utf-8")))
        assert saved == [report]
        png = tmp_path / "ab.png"
        lab.controller.save_png(str(png))
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        lab.view.begin_run("A", "B")  # clears the shown report
        lab.controller.open_file(str(path))
        assert lab.view.report() == report
        assert lab.view.column_text("b") == report["b"]["text"]
        bad = tmp_path / "bad.json"
        bad.write_text('{"format": "something else"}')
        lab.controller.open_file(str(bad))
        lab.controller.open_file(str(tmp_path / "missing.json"))
        assert lab.view.report() == report  # a bad file changes nothing
    finally:
        lab.close()


def test_a_bad_request_says_why_and_the_lab_goes_on(qtbot, tiny):
    lab = Lab(qtbot)
    try:
        lab.controller.run(form(str(tiny), "fp32", "int5", TINY_PROMPT, 4))
        qtbot.waitUntil(lambda: not lab.controller.busy, timeout=LONG_WAIT_MS)
        assert any("unknown precision 'int5'" in n for n in lab.notices), lab.notices
        request = form(str(tiny), "fp32", "int8", TINY_PROMPT, 4)
        request["b"]["model"] = "/nonexistent/model"
        lab.controller.run(request)
        qtbot.waitUntil(lambda: not lab.controller.busy, timeout=LONG_WAIT_MS)
        assert any("/nonexistent/model" in n for n in lab.notices), lab.notices
        assert not any("internal error" in n for n in lab.notices), lab.notices
        lab.controller.run(form(str(tiny), "fp32", "int8", "", 4))  # no prompt
        assert not lab.controller.busy
        report = lab.run(form(str(tiny), "fp32", "int8", TINY_PROMPT, 4))
        assert len(report["a"]["token_ids"]) == 4
    finally:
        lab.close()


def slow_loader(spec: Any, progress: Any, config: Any = None) -> LLMEngine:
    """The real loader, with every step 20 ms slower: a run long enough to cancel by hand."""
    from app.loading import load_engine

    engine = load_engine(spec, progress, config=config)
    step = engine.step

    def slow_step() -> Any:
        time.sleep(0.02)
        return step()

    engine.step = slow_step  # type: ignore[method-assign]
    return engine


def test_the_cancel_button_stops_a_run_and_the_next_one_works(qtbot, tiny):
    lab = Lab(qtbot, loader=slow_loader)
    try:
        lab.controller.run(form(str(tiny), "fp32", "int8", TINY_PROMPT, 200))
        qtbot.waitUntil(lambda: bool(lab.appends["a"]), timeout=LONG_WAIT_MS)
        lab.view.cancel_button.click()  # as the user does, from the UI thread
        qtbot.waitUntil(lambda: not lab.controller.busy, timeout=10_000)
        assert lab.view.report() is None
        assert 0 < len("".join(lab.appends["a"]).split()) < 200
        assert "cancelled or failed" in lab.view.summary_text()
        assert lab.run(form(str(tiny), "fp32", "int8", TINY_PROMPT, 3))["summary"]["tokens"] == 3
        lab.controller.release()  # the user left the tab: the engines go
        qtbot.waitUntil(lambda: not lab.controller.worker._engines, timeout=10_000)
    finally:
        lab.close()


def test_cancel_stops_the_speculative_measurement_too(qtbot, tiny):
    lab = Lab(qtbot)
    worker = lab.controller.worker

    def press_cancel(text: str) -> None:  # as the measurement starts, in the lab's thread
        if text.startswith("speculative"):
            lab.controller.cancel()

    worker.status.connect(press_cancel, Qt.ConnectionType.DirectConnection)
    try:
        lab.controller.run(form(str(tiny), "fp32", "int8", TINY_PROMPT, 6))
        qtbot.waitUntil(lambda: not lab.controller.busy, timeout=LONG_WAIT_MS)
        assert lab.view.report() is None
        assert all(e.speculator is None for e in worker._engines.values())
        worker.status.disconnect(press_cancel)
        report = lab.run(form(str(tiny), "fp32", "int8", TINY_PROMPT, 3))
        assert report["summary"]["speculative"]["measured"]["tokens"] == 3
    finally:
        lab.close()


def test_continuing_the_conversation_sends_its_messages(qtbot, tiny):
    history = [{"role": "user", "content": "t4 t5"}, {"role": "assistant", "content": "t6"}]
    lab = Lab(qtbot, messages=lambda: history)
    try:
        report = lab.run(form(str(tiny), "fp32", "fp32", "t8", 4, continue_conversation=True))
    finally:
        lab.close()
    engine = load_model(tiny)
    words = "t4 t5\nt6\nt8"  # no chat template: the messages' texts, one per line
    assert report["prompt_tokens"] == len(engine.tokenizer.encode_prompt(words))
    assert report["summary"]["kl_max"] == pytest.approx(0.0, abs=1e-9)


@needs_int4
def test_a_scan_shows_bars_and_plans_a_spec_under_the_budget(qtbot, tiny):
    lab = Lab(qtbot)
    try:
        lab.view.set_models([("tiny", str(tiny))])
        lab.controller.start_scan({"model": str(tiny), "low": "int4-g32"})
        qtbot.waitUntil(lambda: lab.controller.scan is not None, timeout=LONG_WAIT_MS)
        scan = lab.controller.scan
        assert scan is not None and len(scan["blocks"]) == 2 * 3
        budget = (scan["min_bytes"] + scan["max_bytes"]) // 2
        lab.controller.plan(budget)
        spec = lab.view.spec_line.text()
        assert spec.startswith("mixed:") and "int8" in spec
        engine = load_model(tiny, precision=spec)
        assert engine.weights_bytes <= budget
    finally:
        lab.close()


@pytest.mark.parametrize("b", ["int8"])
def test_the_lab_on_the_default_model_matches_eval_compare_and_generate(
    qtbot, default_model, capsys, b
):
    """fp32 against int8 streams into both columns; what the view shows equals
    ``infersight eval compare --json`` for the same prompt, and each column equals a separate
    engine's ``generate``: the command's, which generates each side alone on engines of its
    own (:func:`engine.evals.sides.generate`) before it scores them. Twelve tokens: a real
    answer, streamed in several updates, each of its figures checked. The lab's engines are
    on the weights this test process shares (a window's, say), the command's its own."""
    tokens = 12
    lab = Lab(qtbot, loader=SHARED_WEIGHTS)
    try:
        report = lab.run(form("default", "fp32", b, REAL_PROMPT, tokens))
    finally:
        lab.close()
    assert len(lab.appends["a"]) > 1 and len(lab.appends["b"]) > 1  # streamed, not at the end
    argv = ["eval", "compare", "--model", "default", "--a", "fp32", "--b", b,
            "--prompt", REAL_PROMPT, "--new-tokens", str(tokens), "--json"]  # fmt: skip
    assert main(argv) == 0
    (cli,) = read_document(json.loads(capsys.readouterr().out))
    assert report["divergence"]["index"] == cli["divergence"]["index"]
    assert report["summary"]["kl_mean"] == pytest.approx(cli["summary"]["kl_mean"], rel=1e-6)
    assert report["summary"]["top1_agreement"] == cli["summary"]["top1_agreement"]
    shown = lab.view.summary_text()
    assert f"{cli['summary']['top1_agreement']:.1%}" in shown, shown
    from widgets.ab_format import format_kl

    assert format_kl(cli["summary"]["kl_mean"]) in shown, shown
    for key, precision in (("a", "fp32"), ("b", b)):
        assert cli[key]["precision"] == precision and len(cli[key]["token_ids"]) == tokens
        assert report[key]["token_ids"] == cli[key]["token_ids"]
        assert lab.view.column_text(key) == cli[key]["text"] == report[key]["text"]


def test_cancel_stops_a_scan_and_the_lab_goes_on(qtbot, tiny):
    lab = Lab(qtbot)
    worker = lab.controller.worker
    progress: list[int] = []
    # Cancel scan, pressed when the first block is done (in the lab's thread, so that it
    # lands mid-scan however fast the model is)
    worker.scan_progress.connect(
        lambda done, _total: (progress.append(done), lab.controller.cancel()),
        Qt.ConnectionType.DirectConnection,
    )
    try:
        lab.controller.start_scan({"model": str(tiny), "low": "int8"})
        qtbot.waitUntil(lambda: not lab.controller.busy, timeout=LONG_WAIT_MS)
        assert lab.controller.scan is None and progress == [1]
        worker.scan_progress.disconnect()
        assert lab.run(form(str(tiny), "fp32", "int8", TINY_PROMPT, 3))["summary"]["tokens"] == 3
    finally:
        lab.close()


def test_a_run_whose_score_tables_cannot_fit_is_refused_with_the_figure(qtbot, tiny):
    lab = Lab(qtbot, available=lambda _device: 1000.0)
    try:
        lab.controller.run(form(str(tiny), "fp32", "int8", TINY_PROMPT, 50))
        qtbot.waitUntil(lambda: not lab.controller.busy, timeout=LONG_WAIT_MS)
        assert lab.view.report() is None
        assert any("ask for fewer new tokens" in n for n in lab.notices), lab.notices
    finally:
        lab.close()
