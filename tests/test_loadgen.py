"""The load generator and the sweep's analysis (engine/bench/loadgen.py, tuning.py,
sweep_analysis.py): arrivals as specified, concurrency as specified, nothing left behind by a
stop, the limits a sweep applies and puts back, and the figures read off a sweep."""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path

import pytest

from engine.bench.load_spec import SLO, LoadResult, LoadSpec, PromptMix
from engine.bench.loadgen import LoadGenerator, drive, request_stream
from engine.bench.sweep_analysis import (
    Setting,
    SweepPoint,
    best_for_slo,
    capacity,
    grid,
    knee,
    pareto_front,
    sweep_report,
)
from engine.bench.tuning import Sweep
from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.metrics import RequestMetrics
from engine.core.scheduler import SchedulerLimits
from engine.errors import InvalidRequestError
from engine.loader.load import load_model

pytestmark = pytest.mark.real_model

SHORT = PromptMix(documents=0.3, conversations=0.0, output_median=6, output_min=4, output_max=8)


@pytest.fixture(scope="module")
def engine(default_model: Path) -> LLMEngine:
    return load_model(
        default_model, config=EngineConfig(num_blocks=256, limits=SchedulerLimits(8, 256))
    )


def idle(engine: LLMEngine) -> None:
    assert not engine.has_work()
    assert engine.kv.manager.num_used == 0


# -- the requests ------------------------------------------------------------------------------


def test_requests_are_seeded_mixed_and_fit(engine: LLMEngine) -> None:
    mix = PromptMix(documents=0.25, conversations=0.25, conversation_tokens=(400, 700))
    spec = LoadSpec(seed=3, mix=mix)
    first = list(itertools.islice(request_stream(engine, spec), 60))
    again = list(itertools.islice(request_stream(engine, spec), 60))
    other = list(itertools.islice(request_stream(engine, LoadSpec(seed=4, mix=mix)), 60))
    assert [r.prompt_ids for r in first] == [r.prompt_ids for r in again]
    assert [r.prompt_ids for r in first] != [r.prompt_ids for r in other]
    kinds = {k: [r for r in first if r.kind == k] for k in ("question", "document", "conversation")}
    assert all(kinds.values()), "every kind of prompt appears"
    longest_question = max(len(r.prompt_ids) for r in kinds["question"])
    assert min(len(r.prompt_ids) for r in kinds["conversation"]) > 3 * longest_question
    for r in first:
        assert mix.output_min <= r.max_new_tokens <= mix.output_max
        assert len(r.prompt_ids) + r.max_new_tokens < engine.context_length


def test_requests_fit_a_small_pool(engine: LLMEngine) -> None:
    small = engine.sibling(EngineConfig(num_blocks=24))  # 384 tokens
    mix = PromptMix(conversations=1.0, documents=0.0, conversation_tokens=(900, 1000))
    for r in itertools.islice(request_stream(small, LoadSpec(mix=mix)), 5):
        assert len(r.prompt_ids) + r.max_new_tokens <= 24 * 16


# -- arrivals and concurrency ------------------------------------------------------------------


def test_constant_rate_sends_on_schedule(engine: LLMEngine) -> None:
    gen = LoadGenerator(engine, LoadSpec(mode="constant", rate=4.0, requests=5, mix=SHORT))
    t0 = 1000.0
    gen.tick(t0)
    assert gen.sent == 1
    gen.tick(t0 + 0.24)
    assert gen.sent == 1
    gen.tick(t0 + 0.25)
    assert gen.sent == 2
    gen.tick(t0 + 10.0)  # late: every due request goes, each with its own due time
    assert gen.sent == 5
    arrivals = sorted(engine.sequence(f"load-{i}").arrival for i in range(5))
    assert arrivals == pytest.approx([t0 + 0.25 * i for i in range(5)])
    gen.stop()
    engine.step()
    idle(engine)
    assert gen.finished and gen.result().stopped


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_poisson_gaps_have_the_rate_and_burstiness_asked_for(
    engine: LLMEngine, burstiness: float
) -> None:
    gen = LoadGenerator(engine, LoadSpec(mode="poisson", rate=2.0, burstiness=burstiness))
    gaps = [gen._gap() for _ in range(20000)]
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2  # gamma: 1 / shape
    assert cv2 == pytest.approx(1 / burstiness, rel=0.1)


def test_closed_loop_keeps_exactly_the_users_busy(engine: LLMEngine) -> None:
    users = 3
    gen = LoadGenerator(engine, LoadSpec(users=users, requests=6, mix=SHORT))
    in_flight = []
    while not gen.finished:
        gen.tick(0.0)
        in_flight.append(gen.outstanding)
        gen.observe(engine.step())
    assert max(in_flight) == users
    assert in_flight[0] == users  # all users start at once
    result = gen.result()
    assert result.completed == 6 and result.failed == 0
    assert 1 < result.mean_batch_size <= users
    idle(engine)


def test_retargeting_turns_the_users_and_the_rate_while_the_load_runs(engine: LLMEngine) -> None:
    gen = LoadGenerator(engine, LoadSpec(users=2, requests=None, mix=SHORT))
    gen.tick(0.0)
    assert gen.outstanding == 2
    gen.retarget(users=5)  # three more start at the next tick
    gen.tick(0.0)
    assert gen.outstanding == 5
    gen.retarget(users=1)  # four leave as their requests end; nobody is cancelled
    assert gen.outstanding == 5
    in_flight = []
    for _ in range(60):
        gen.observe(engine.step())
        gen.tick(0.0)
        in_flight.append(gen.outstanding)
    assert in_flight == sorted(in_flight, reverse=True) and in_flight[-1] == 1
    gen.stop()
    engine.step()
    idle(engine)
    # open loop: the next arrival's gap scales to the new rate, the ones after are its own
    gen = LoadGenerator(engine, LoadSpec(mode="constant", rate=1.0, requests=None, mix=SHORT))
    gen.tick(100.0)
    gen.tick(101.0)
    assert gen.sent == 2 and gen.next_arrival_in(101.0) == pytest.approx(1.0)
    gen.retarget(rate=4.0)
    assert gen.next_arrival_in(101.0) == pytest.approx(0.25)
    gen.tick(101.25)
    gen.tick(101.5)
    assert gen.sent == 4 and gen.result(101.5).load == "4 req/s constant"
    gen.stop()
    engine.step()
    idle(engine)


def test_duration_stops_sending_and_lets_the_rest_finish(engine: LLMEngine) -> None:
    gen = LoadGenerator(
        engine, LoadSpec(mode="constant", rate=10, requests=None, duration_s=0.5, mix=SHORT)
    )
    gen.tick(50.0)
    gen.tick(50.45)
    sent = gen.sent
    assert sent == 5
    gen.tick(60.0)  # due after the duration: not sent
    assert gen.sent == sent
    while not gen.finished:
        gen.observe(engine.step())
    assert gen.result().completed == sent
    idle(engine)


def test_a_full_queue_makes_a_closed_loop_user_send_the_same_request_again(
    engine: LLMEngine,
) -> None:
    spec = LoadSpec(users=3, requests=6, mix=SHORT)
    engine.update_limits(max_batch_size=1, max_waiting=1)
    try:
        gen = LoadGenerator(engine, spec)
        drive(engine, gen)
    finally:
        engine.update_limits(max_batch_size=8, max_waiting=1024)
    result = gen.result()
    assert result.refused > 0  # turned away, and sent again: not a failure
    assert (result.completed, result.failed) == (6, 0)
    # the same requests: the stream's first six (a new draw for each refusal would differ)
    first = itertools.islice(request_stream(engine, spec), 6)
    assert result.total_input_tokens == sum(len(r.prompt_ids) for r in first)
    idle(engine)


def test_limits_a_live_request_could_not_fit_under_are_refused(engine: LLMEngine) -> None:
    from engine.core.sampling import SamplingParams
    from engine.kv_cache.window import CacheWindow

    rid = engine.add_request(list(range(10, 500)), SamplingParams(max_new_tokens=200))
    try:
        with pytest.raises(InvalidRequestError, match="at least 44 blocks"):
            engine.update_limits(kv_blocks=20)  # 690 tokens: 44 blocks of 16
        engine.set_window(CacheWindow(sink=4, window=64))  # it holds at most ~400 tokens now
        engine.update_limits(kv_blocks=30)
        with pytest.raises(InvalidRequestError, match="at least 44 blocks"):
            engine.set_window(None)  # without the window it would need 44
        with pytest.raises(InvalidRequestError):
            engine.update_limits(max_tokens_per_step=2048)  # a longer chunk holds more
        assert engine.window is not None and engine.kv.manager.capacity == 30
    finally:
        engine.cancel(rid)
        engine.step()
        engine.set_window(None)
        engine.update_limits(kv_blocks=engine.kv.manager.num_blocks)
    idle(engine)


def test_stop_mid_run_cancels_everything_and_returns_every_block(engine: LLMEngine) -> None:
    gen = LoadGenerator(engine, LoadSpec(users=4, requests=None, mix=SHORT))
    for _ in range(3):
        gen.tick(0.0)
        gen.observe(engine.step())
    assert engine.kv.manager.num_used > 0
    drive(engine, gen, should_stop=lambda: True)
    assert gen.finished and gen.stopped
    idle(engine)
    out = list(engine.generate([1, 2, 3], engine_params()))  # the engine still answers
    assert out[-1].finish_reason == "length"


def engine_params():
    from engine.core.sampling import SamplingParams

    return SamplingParams(max_new_tokens=3)


# -- figures -----------------------------------------------------------------------------------


def metrics(rid: str, ttft: float, tpot: float, n: int = 5) -> RequestMetrics:
    gaps = (tpot,) * (n - 1)
    return RequestMetrics(rid, "length", 10, n, 0.0, ttft, tpot, ttft + tpot * (n - 1), gaps)


def test_slo_parsing_and_goodput(engine: LLMEngine) -> None:
    slo = SLO.parse("ttft=500ms, tpot=0.1s")
    assert (slo.ttft_s, slo.tpot_s) == (0.5, 0.1)
    assert SLO.parse("ttft=250").ttft_s == 0.25  # a bare number is milliseconds
    for bad in ("", "ttft", "itl=5ms", "ttft=-1ms", "ttft=fast"):
        with pytest.raises(InvalidRequestError):
            SLO.parse(bad)
    assert slo.met_by(metrics("a", 0.4, 0.09))
    assert not slo.met_by(metrics("b", 0.6, 0.09))
    assert not slo.met_by(metrics("c", 0.4, 0.2))

    gen = LoadGenerator(engine, LoadSpec(requests=3), slo=slo)
    gen.started, gen.ended = 10.0, 12.0
    gen.records = [metrics("a", 0.4, 0.05), metrics("b", 0.6, 0.05), metrics("c", 0.1, 0.02)]
    r = gen.result()
    assert r.request_goodput == pytest.approx(2 / 2.0)
    assert r.slo_attainment == pytest.approx(2 / 3)
    assert r.request_throughput == pytest.approx(1.5)
    assert r.ttft_ms["median"] == pytest.approx(400)
    assert r.ttft_ms["p99"] == pytest.approx(400 + (600 - 400) * 0.98)  # between ranks, numpy's
    flat = r.as_json()
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p95_e2el_ms", "request_goodput"):
        assert key in flat


# -- sweeps ------------------------------------------------------------------------------------


def test_sweep_applies_each_setting_and_puts_the_limits_back(engine: LLMEngine) -> None:
    base = LoadSpec(users=2, requests=3, mix=SHORT)
    assert [s.label() for s in grid(base, max_batch_size=[1, 4], loads=[1, 3])] == [
        "b1 1 users", "b1 3 users", "b4 1 users", "b4 3 users",
    ]  # fmt: skip
    settings = grid(base, max_batch_size=[1, 4], max_tokens_per_step=[64], loads=[3])
    before = engine.scheduler.limits
    sweep = Sweep(engine, settings)
    seen: dict[int, set[int]] = {}
    while not sweep.finished:
        index = sweep.progress().index
        sweep.tick(0.0)
        limits = engine.scheduler.limits
        events = engine.step()
        if engine.collector.recent:
            step = engine.collector.recent[-1]
            assert step.batch_size <= limits.max_batch_size
            assert step.decode_tokens + step.prefill_tokens <= 64
        seen.setdefault(index, set()).add(limits.max_batch_size)
        sweep.observe(events)
    assert seen[0] == {1} and seen[1] == {4}
    assert [p.result.completed for p in sweep.points] == [3, 3]
    assert engine.scheduler.limits == before
    idle(engine)


def test_stopping_a_sweep_keeps_its_points_and_frees_everything(engine: LLMEngine) -> None:
    before = engine.scheduler.limits
    settings = grid(LoadSpec(users=2, requests=2, mix=SHORT), max_batch_size=[2, 3, 5])
    sweep = Sweep(engine, settings)
    drive(engine, sweep, should_stop=lambda: len(sweep.points) >= 1)
    assert sweep.stopped and len(sweep.points) == 1
    assert engine.scheduler.limits == before
    idle(engine)


def test_kv_cap_is_checked_and_lowering_it_mid_run_preempts(engine: LLMEngine) -> None:
    mgr = engine.kv.manager
    with pytest.raises(InvalidRequestError, match="pool's size"):
        engine.update_limits(kv_blocks=mgr.num_blocks + 1)
    # 16 new tokens at least: each running document crosses a block boundary after the cap
    mix = PromptMix(documents=0.6, conversations=0.0, output_median=16, output_min=16,
                    output_max=18)  # fmt: skip
    gen = LoadGenerator(engine, LoadSpec(users=4, requests=4, mix=mix))
    try:
        while mgr.num_used < 30:  # documents of ~15 blocks each are running
            gen.tick(0.0)
            gen.observe(engine.step())
        engine.update_limits(kv_blocks=20)  # as the tuner's slider does, under what is in use
        assert engine.metrics().limits["kv_blocks"] == 20
        held: list[int] = []  # blocks in use after each step under the cap
        drive(engine, gen, on_step=lambda: held.append(mgr.num_used))
        result = gen.result()
        assert result.completed == 4
        assert result.preemptions > 0 and engine.metrics().total_preemptions > 0
        # What was in use may stay until a sequence needs a block more; then preemption
        # brings the pool under the cap, which nothing crosses again.
        under = next(i for i, n in enumerate(held) if n <= 20)
        assert max(held[:under], default=0) <= held[0] and max(held[under:]) <= 20
    finally:
        engine.update_limits(kv_blocks=mgr.num_blocks)
    idle(engine)


# -- reading a sweep ---------------------------------------------------------------------------


def point(load: float, throughput: float, ttft_p95: float, tpot_p95: float = 50.0) -> SweepPoint:
    stats = lambda v: {"mean": v, "median": v, "p95": v, "p99": v}  # noqa: E731
    result = LoadResult(
        setting={}, load=f"{load:g}", completed=10, failed=0, duration=10.0,
        total_input_tokens=1000, total_output_tokens=int(throughput * 10),
        request_throughput=throughput / 100, output_throughput=throughput,
        total_token_throughput=throughput + 100, ttft_ms=stats(ttft_p95),
        tpot_ms=stats(tpot_p95), itl_ms=stats(tpot_p95), e2el_ms=stats(ttft_p95),
        queue_ms=stats(0.0), preemptions=0, mean_batch_size=1.0, mean_tokens_per_request=200.0,
    )  # fmt: skip
    return SweepPoint(Setting({"max_batch_size": 8}, LoadSpec(users=int(load))), result)


def test_pareto_front_and_best_for_an_slo() -> None:
    a, b, c, d = point(1, 100, 200), point(2, 180, 300), point(4, 170, 900), point(8, 250, 2500)
    front = pareto_front([a, b, c, d])
    assert front == [a, b, d]  # c: b has more throughput at less latency
    assert best_for_slo([a, b, c, d], SLO(ttft_s=1.0)) is b
    assert best_for_slo([a, b, c, d], SLO(ttft_s=3.0)) is d
    assert best_for_slo([a, b, c, d], SLO(ttft_s=0.1)) is None
    slow = point(16, 300, 100, tpot_p95=500)
    assert best_for_slo([a, slow], SLO(tpot_s=0.2)) is a


def test_knee_is_where_latency_bends_and_capacity_follows() -> None:
    curve = [point(1, 100, 100), point(2, 200, 110), point(4, 380, 130), point(8, 420, 900),
             point(16, 430, 4000)]  # fmt: skip
    k = knee(curve)
    assert k is not None and k.load == 4
    cap = capacity(k, 10.0)  # 10 req/s × 3 × 1.5 = 45 req/s at 3.8 req/s each
    assert cap.machines == math.ceil(45 / 3.8)
    assert cap.tokens_per_request == 200.0
    assert "12 needed" in cap.describe()
    assert knee([point(1, 100, 100), point(2, 200, 200), point(4, 400, 400)]) is None  # linear
    assert knee(curve[:3]) is None  # latency has not bent yet: sweep further
    assert knee(curve[:2]) is None
    report = sweep_report(curve, SLO(ttft_s=1.0), target_rate=10.0)
    assert report["best_for_slo"] == curve[3].label
    (series_knee,) = report["knees"].values()
    assert series_knee["capacity"]["machines"] == cap.machines
    with pytest.raises(InvalidRequestError):
        capacity(k, 0.0)
