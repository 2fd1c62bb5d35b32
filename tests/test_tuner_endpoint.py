"""The batching tuner against a server: the load turned while it runs (the server's own count
of requests at once is the oracle), the server's /metrics read under vLLM's, SGLang's and
llama.cpp's names, and the real window driving ``infersight serve`` in a child process (live
load, the users turned, a sweep) and the test's misbehaving server (a rate limit marked where
it struck, an unreachable server in one line)."""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import itertools

import pytest

from app.endpoints.client import Endpoint, session, with_model
from app.endpoints.load import EndpointLoad
from app.endpoints.server_metrics import parse, scrape
from app.gui.main_window import MainWindow
from engine.bench.load_spec import LoadSpec, PromptMix
from engine.bench.sweep_analysis import knee
from tests.app_window import LONG_WAIT_MS
from tests.misbehaving import RIGHT, Concurrency
from tests.served import KEY
from tests.test_tuner_app import window as window  # the real window on its tuner page

SHORT = PromptMix(documents=0.0, conversations=0.0, output_median=6, output_min=3, output_max=9)


def peak(seconds: float) -> int:
    """The most requests the ``tick`` server served at once over ``seconds``."""
    seen, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        with Concurrency.lock:
            seen = max(seen, Concurrency.now)
        time.sleep(0.01)
    return seen


# -- the load, turned ----------------------------------------------------------------------------


def test_turning_the_users_changes_what_the_server_serves_at_once(misbehaving):
    tick = Endpoint(misbehaving, model="tick", api_key=RIGHT)
    load = EndpointLoad(tick, LoadSpec(users=1, requests=None, mix=SHORT)).start()
    try:
        assert peak(0.8) == 1
        load.retarget(users=3)
        assert peak(0.8) == 3
        load.retarget(users=1)  # two leave as their requests (0.4 s) end; none is cut
        time.sleep(0.6)
        assert peak(0.8) == 1
        live = load.live()
    finally:
        load.stop()
        assert load.wait(5.0)
    run = load.run()
    assert not run.failures and run.result.completed >= 6
    cut = [r for r in run.records if r.cut]
    assert len(cut) <= 1  # the one user left when Stop came; none cut by the turn
    assert [users for _, users in run.users] == [1, 3, 1]
    assert live.load == 1 and live.in_flight <= 1 and live.completed > 0
    assert live.ttft_ms[0] <= live.ttft_ms[1] and live.ttft_ms[0] > 0
    assert live.server is None  # this server has no /metrics: its queue is not visible


def test_users_turned_down_under_a_request_limit_still_end_the_run(misbehaving):
    tick = Endpoint(misbehaving, model="tick", api_key=RIGHT)
    load = EndpointLoad(tick, LoadSpec(users=3, requests=6, mix=SHORT)).start()
    load.retarget(users=1)  # two users wait to be needed; the limit is reached without them
    assert load.wait(10.0), "the run did not end"
    assert load.run().result.completed == 6


def test_a_stop_cuts_a_request_still_waiting_for_its_first_byte(misbehaving):
    slow = Endpoint(misbehaving, model="slow", api_key=RIGHT)  # two seconds before a byte
    load = EndpointLoad(slow, LoadSpec(users=2, requests=None, mix=SHORT)).start()
    time.sleep(0.3)
    began = time.perf_counter()
    load.stop()
    assert load.wait(1.5) and time.perf_counter() - began < 1.5
    run = load.run()
    assert len(run.records) == 2 and all(r.cut for r in run.records) and not run.failures


def test_turning_the_rate_changes_the_gaps_from_the_next_arrival(misbehaving):
    Concurrency.reset()
    tick = Endpoint(misbehaving, model="tick", api_key=RIGHT)
    load = EndpointLoad(tick, LoadSpec(mode="constant", rate=2.0, requests=None, mix=SHORT))
    load.start()
    try:
        time.sleep(1.2)  # arrivals at 0, 0.5, 1.0 s
        load.retarget(rate=20.0)
        time.sleep(0.8)
    finally:
        load.stop()
        assert load.wait(5.0)
    with Concurrency.lock:
        arrivals = list(Concurrency.arrivals)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert len(arrivals) >= 8
    assert min(gaps[:2]) > 0.4  # 1/2 s apart
    assert statistics.median(gaps[3:]) < 0.1  # 1/20 s apart after the turn


# -- the server's own figures ----------------------------------------------------------------------

VLLM = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 3.0
vllm:num_requests_running{model_name="b"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="a"} 0.25
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{model_name="a"} 7.0
"""
SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 5.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 0.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.5
"""
LLAMACPP = """# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 4
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.125
"""


def test_a_servers_metrics_are_read_under_each_servers_names(server):
    vllm, sglang, llama = parse(VLLM), parse(SGLANG), parse(LLAMACPP)
    assert vllm is not None and (vllm.running, vllm.waiting, vllm.kv_usage) == (4, 2, 0.25)
    assert vllm.preemptions == 7
    assert sglang is not None and (sglang.running, sglang.waiting, sglang.kv_usage) == (5, 0, 0.5)
    assert math.isnan(sglang.preemptions)
    assert llama is not None and (llama.running, llama.waiting, llama.kv_usage) == (1, 4, 0.125)
    assert parse('{"data": []}') is None and parse("# nothing here\n") is None
    endpoint = with_model(Endpoint(server, api_key=KEY))
    with session(endpoint, 1) as client:
        ours = scrape(endpoint, client)  # infersight serve exports vLLM's names
        assert ours is not None and ours.running >= 0 and 0 <= ours.kv_usage <= 1
        assert ours.preemptions >= 0
        assert scrape(Endpoint("http://127.0.0.1:9"), client) is None  # nobody listening


# -- the window ----------------------------------------------------------------------------------


def start_live(qtbot, window: MainWindow, target: str, users: int, output: int = 0) -> None:
    tuner = window.tuner
    tuner.target_edit.setText(target)
    assert tuner.limits_group.isHidden()  # a server's limits are its own
    tuner.mode_combo.setCurrentText("closed")
    tuner.users_spin.setValue(users)
    tuner.output_spin.setValue(output or tuner.output_spin.minimum())
    tuner.start_button.click()
    qtbot.waitUntil(lambda: tuner.live.remote is not None, timeout=LONG_WAIT_MS)


def stop(qtbot, window: MainWindow) -> None:
    tuner = window.tuner
    tuner.stop_button.click()
    qtbot.waitUntil(tuner.start_button.isEnabled, timeout=LONG_WAIT_MS)


def batch_seen(window: MainWindow) -> float:
    """The most requests the server said it ran at once, on the live plot."""
    rows = window.tuner.live._live.view()
    return float(max((r for r in rows[:, 6] if not math.isnan(r)), default=0))


@pytest.mark.real_model
@pytest.mark.usefixtures("gui_gc")
def test_the_window_drives_a_server_live_and_turns_its_users(qtbot, window, server, monkeypatch):
    monkeypatch.setenv("INFERSIGHT_ENDPOINT_KEY", KEY)
    tuner = window.tuner
    start_live(qtbot, window, server, users=1)
    assert not tuner.live.remote_note.isHidden() and tuner.live.strip.isHidden()
    qtbot.waitUntil(lambda: "done" in tuner.load_figures.text(), timeout=LONG_WAIT_MS)
    assert batch_seen(window) <= 1  # the server's own running count, from its /metrics
    tuner.users_spin.setValue(4)  # turned mid-run: three users join
    qtbot.waitUntil(lambda: batch_seen(window) >= 2, timeout=LONG_WAIT_MS)
    live = window.tune_router.live_load
    assert live is not None and live.server is not None  # the batch curve is the server's
    stop(qtbot, window)
    assert tuner.status_label.text() == "stopped"
    run = window.tune_router.runs[0]
    assert [u for _, u in run.users][:2] == [1, 4] and not run.failures
    assert run.result.completed > 0 and tuner.load_figures.text().startswith(
        f"{run.result.completed} done"
    )
    assert window.worker.engine is not None and not window.worker.engine.has_work()


@pytest.mark.real_model
@pytest.mark.usefixtures("gui_gc")
def test_the_window_marks_a_rate_limit_and_names_an_unreachable_server(
    qtbot, window, misbehaving, monkeypatch
):
    monkeypatch.setenv("INFERSIGHT_ENDPOINT_KEY", RIGHT)
    tuner = window.tuner
    start_live(qtbot, window, f"{misbehaving} busy", users=2)
    qtbot.waitUntil(lambda: len(tuner.live.failures()) >= 2, timeout=LONG_WAIT_MS)
    assert {kind for _, kind in tuner.live.failures()} == {"rate_limited"}
    qtbot.waitUntil(lambda: "rate_limited" in tuner.status_label.text(), timeout=LONG_WAIT_MS)
    stop(qtbot, window)
    line = tuner.status_label.text()
    assert "rate_limited" in line and "retry after 3 s" in line and "\n" not in line
    tuner.target_edit.setText("http://127.0.0.1:9")
    tuner.start_button.click()
    qtbot.waitUntil(lambda: "unreachable" in tuner.status_label.text(), timeout=LONG_WAIT_MS)
    qtbot.waitUntil(tuner.start_button.isEnabled, timeout=LONG_WAIT_MS)
    assert "\n" not in tuner.status_label.text()


@pytest.mark.real_model
@pytest.mark.usefixtures("gui_gc")
def test_the_window_sweeps_a_server_and_reads_the_best_load(
    qtbot, window, server, monkeypatch, tmp_path
):
    monkeypatch.setenv("INFERSIGHT_ENDPOINT_KEY", KEY)
    tuner = window.tuner
    tuner.target_edit.setText(server)
    tuner.tabs.setCurrentIndex(1)
    tuner.loads_edit.setText("1 2 4")
    tuner.requests_spin.setValue(3)
    tuner.sweep_output_spin.setValue(tuner.sweep_output_spin.minimum())
    tuner.conversations_spin.setValue(0.0)
    tuner.slo_edit.setText("ttft=60s,tpot=10s")
    assert not tuner.batch_edit.isEnabled()
    tuner.run_button.click()
    qtbot.waitUntil(lambda: len(tuner.sweep_points()) == 3, timeout=3 * LONG_WAIT_MS)
    qtbot.waitUntil(tuner.run_button.isEnabled, timeout=LONG_WAIT_MS)
    points = tuner.sweep_points()
    assert [p.label for p in points] == ["1 users", "2 users", "4 users"]
    assert all(p.result.completed == 3 and not p.setting.limits for p in points)
    assert tuner.best_label() in ("1 users", "2 users", "4 users")
    assert not tuner.apply_button.isEnabled()  # a server's limits are not ours to set
    assert tuner.progress.format() == "3/3 done" and tuner.status_label.text() == "sweep done"
    # the capacity plan reads the server's sweep (a knee, or why none); no config of ours
    capacity = tuner.capacity_text.text()
    if knee(points) is None:
        assert capacity.startswith("No knee yet"), capacity
    else:
        assert f"knee at load {knee(points).load:g}" in capacity, capacity
        assert capacity.endswith("(servers like the one measured)"), capacity
    assert not tuner.capacity.export_button.isEnabled()
    path = tmp_path / "benchmarks.json"
    tuner.export_guidellm.emit(str(path))  # as the button's dialog does
    assert tuner.status_label.text() == f"GuideLLM's report of 3 runs: {path}"
    schemas = pytest.importorskip("guidellm.benchmark.schemas")
    report = schemas.GenerativeBenchmarksReport.load_file(path)
    assert [b.config.strategy.streams for b in report.benchmarks] == [1, 2, 4]
    assert [b.metrics.request_totals.successful for b in report.benchmarks] == [3, 3, 3]


@pytest.mark.skipif(
    not os.environ.get("INFERSIGHT_SCREENSHOTS"), reason="renders for the docs (make screenshots)"
)
@pytest.mark.usefixtures("gui_gc")
def test_tuner_endpoint_screenshot(qtbot, window, server, monkeypatch):
    """The tuner at 1280×800 driving ``infersight serve``: 2 users, turned to 6 mid-run."""
    monkeypatch.setenv("INFERSIGHT_ENDPOINT_KEY", KEY)
    out = Path(os.environ["INFERSIGHT_SCREENSHOTS"])
    window.resize(1280, 800)
    start_live(qtbot, window, server, users=2, output=64)
    tuner = window.tuner
    qtbot.wait(8000)
    tuner.users_spin.setValue(6)
    qtbot.wait(10000)
    tuner.redraw()
    window.grab().save(str(out / "tuner-endpoint.png"))
    stop(qtbot, window)
    assert (out / "tuner-endpoint.png").stat().st_size > 10_000
