"""``infersight serve --ray``: the pieces without Ray (the prompt's routing keys, the router's
policy, the gathered metrics, a request run through a replica's app, the config files), then
the command as a user runs it: a subprocess starting a local Ray instance with two replicas
of the default model, spoken to through Ray's proxy with the real ``openai`` SDK and raw
HTTP; one replica killed under load; Ctrl+C leaving no Ray process behind."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app.replicas.forwarding import CHUNK_CHARS, Forwarded, call, prefix_keys, prompt_text
from app.replicas.metrics import merge
from app.replicas.router import preferred
from engine.core.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.loader.load import load_model
from tests.test_server import KEY, greedy, request

MODEL = "SmolLM2-135M-Instruct"

# -- without Ray --------------------------------------------------------------------------------


def test_prompts_sharing_their_beginning_share_their_leading_keys() -> None:
    system = "You are a careful assistant who answers in one short sentence. " * 3

    def chat(question: str) -> str:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return prompt_text("/v1/chat/completions", json.dumps({"messages": messages}).encode())

    a, b = chat("Why is the sky blue? " * 8), chat("What is rain made of? " * 8)
    ka, kb = prefix_keys(a), prefix_keys(b)
    same = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    shared = same // CHUNK_CHARS
    assert shared >= 2 and ka[:shared] == kb[:shared] and ka[shared:] != kb[shared:]
    assert prefix_keys("x" * (CHUNK_CHARS - 1)) == ()  # no whole chunk: no key
    assert prompt_text("/v1/completions", b'{"prompt": ["one"]}') == "one"
    assert prompt_text("/v1/models", b"") == "" and prompt_text("/v1/completions", b"{") == ""


def test_the_router_prefers_the_replica_with_the_prefix_unless_it_is_busier() -> None:
    owners = {"k1": "a", "k2": "a", "k3": "b"}  # each key: the last replica sent it
    queues = {"a": 1, "b": 0}
    # b was sent the longest prefix (a key chains every chunk before it): it holds all three
    assert preferred(["k1", "k2", "k3"], ["a", "b"], owners, queues.get) == ("b", 3)
    assert preferred(["k1", "k2", "k4"], ["a", "b"], owners, queues.get) == ("a", 2)
    assert preferred(["k9"], ["a", "b"], owners, queues.get) == (None, 0)  # never seen
    assert preferred(["k1"], ["b"], owners, queues.get) == (None, 0)  # its replica is gone
    queues["a"] = 5  # more than SLACK longer than the shortest: power of two choices instead
    assert preferred(["k1"], ["a", "b"], owners, queues.get) == (None, 0)
    assert preferred(["k1"], ["a", "b"], owners, {}.get) == ("a", 1)  # queues unknown


def test_every_replicas_metrics_in_one_exposition_labelled_by_replica() -> None:
    texts = {}
    for replica, done in (("r1", 3), ("r2", 5)):
        registry = CollectorRegistry()
        c = Counter("vllm:request_success", "finished", ["model_name"], registry=registry)
        c.labels(MODEL).inc(done)
        texts[replica] = generate_latest(registry).decode()
    families = list(text_string_to_metric_families(merge(texts).decode()))
    names = [f.name for f in families]
    assert len(names) == len(set(names)) and "vllm:request_success" in names  # once each
    family = next(f for f in families if f.name == "vllm:request_success")
    samples = {s.labels["replica"]: s.value for s in family.samples
               if s.name.endswith("_total")}  # fmt: skip
    assert samples == {"r1": 3.0, "r2": 5.0}


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir):  # the replica's app over the tiny model, no HTTP
    from app.server.routes import Server

    folder, _ = tiny_model_dir("llama", False)
    server = Server(load_model(folder), limits=None)
    server.loop.start()
    yield server
    server.loop.stop()


def _completion(prompt: list[int], stream: bool) -> Forwarded:
    body = {"model": "x", "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": stream}
    return Forwarded("POST", "/v1/completions", b"", [(b"content-type", b"application/json")],
                     json.dumps(body).encode(), ("127.0.0.1", 1))  # fmt: skip


def test_a_request_runs_through_the_replicas_app_as_it_would_over_http(
    tiny_server, tiny_model_dir
) -> None:
    """The parts a replica streams back: the start with the app's status and headers, then
    its body; a model name it does not serve is the app's own error (400)."""
    server = tiny_server

    async def parts(request: Forwarded) -> list[tuple[object, ...]]:
        return [p async for p in call(server.app, request)]

    prompt = [5, 6, 7, 8]
    got = asyncio.run(parts(_completion(prompt, stream=False)))
    (kind, status, _), *body = got
    assert kind == "start" and status == 400  # "x" is not the model's name: its own error
    assert b"model_not_found" in b"".join(b for _, b in body)
    right = json.loads(_completion(prompt, False).body) | {"model": server.name}
    ok = Forwarded("POST", "/v1/completions", b"", [(b"content-type", b"application/json")],
                   json.dumps(right).encode(), ("127.0.0.1", 1))  # fmt: skip
    (_, status, _), *body = asyncio.run(parts(ok))
    reply = json.loads(b"".join(b for _, b in body))
    engine = load_model(tiny_model_dir("llama", False)[0])  # the server's thread owns its own
    want = engine.generate(prompt, engine_params(6))
    list(want)
    assert status == 200 and reply["choices"][0]["text"] == want.result.text


def engine_params(tokens: int):
    from engine.core.sampling import SamplingParams

    return SamplingParams(max_new_tokens=tokens, temperature=0.0)


def test_a_stream_left_early_cancels_the_replicas_request(tiny_server) -> None:
    """The front stops reading (its client went away): the app is told the client
    disconnected, and the engine's request is cancelled (the engine has no work left)."""
    server = tiny_server
    body = {"model": server.name, "prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0,
            "stream": True}  # fmt: skip
    request = Forwarded("POST", "/v1/completions", b"", [(b"content-type", b"application/json")],
                        json.dumps(body).encode(), ("127.0.0.1", 1))  # fmt: skip

    async def read_a_little() -> int:
        seen = 0
        async for kind, *_ in call(server.app, request):
            seen += kind == "body"
            if seen == 3:
                break
        return seen

    assert asyncio.run(read_a_little()) == 3
    deadline = time.monotonic() + 10
    while server.engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.engine.has_work()


def test_rays_health_check_replaces_a_replica_whose_self_test_fails(tiny_server) -> None:
    """The engine replica's ``check_health`` (Ray replaces a replica after it raises three
    times): quiet while the server is well, even with its queue full; raising, with the
    reason, once the self-test gave another answer or the engine's thread stopped."""
    from app.replicas.deployments import EngineReplica

    class Probe(EngineReplica.func_or_class):  # the replica's class, without Ray's start
        def __init__(self) -> None:
            self.server = tiny_server

        def __del__(self) -> None:  # it started nothing to stop
            pass

    replica = Probe()
    replica.check_health()
    tiny_server.admission.requests = tiny_server.limits.max_waiting  # a full queue is fine
    try:
        replica.check_health()
        tiny_server.self_test.ok, tiny_server.self_test.error = False, "another answer"
        with pytest.raises(RuntimeError, match="the self-test failed: another answer"):
            replica.check_health()
    finally:
        tiny_server.admission.requests = 0
        tiny_server.self_test.ok, tiny_server.self_test.error = None, None


def test_the_tuners_capacity_plan_is_a_config_serve_ray_takes(tmp_path) -> None:
    """A knee and a capacity of 3 machines: the config has 3 engine replicas taking the
    knee's concurrency each, the knee setting's batch limit; `serve --ray --config` reads it
    (and the tuner's whole --json report) into the same plan."""
    from app.cli.main import build_parser
    from app.cli.serve_ray import plan
    from engine.bench.load_spec import LoadResult, LoadSpec
    from engine.bench.sweep_analysis import Knee, Setting, SweepPoint, capacity, serve_config

    setting = Setting({"max_batch_size": 8}, LoadSpec(mode="closed", users=6, requests=32))
    stats = {"mean": 1.0, "median": 1.0, "p95": 1.0, "p99": 1.0}
    result = LoadResult(
        setting=setting.as_dict(), load=setting.load.describe(), completed=32, failed=0,
        duration=16.0, total_input_tokens=3200, total_output_tokens=3200,
        request_throughput=2.0, output_throughput=200.0, total_token_throughput=400.0,
        ttft_ms=stats, tpot_ms=stats, itl_ms=stats, e2el_ms=stats, queue_ms=stats,
        preemptions=0, mean_batch_size=6.0, mean_tokens_per_request=100.0,
    )  # fmt: skip
    p = SweepPoint(setting, result)  # a closed-loop point: 6 users in flight
    k = Knee(p, 6.0, 2.0, 100.0)
    cap = capacity(k, 1.0, peak_factor=3.0, headroom=2.0)  # 6 req/s at 2 a machine
    config = serve_config(k, cap, model="default", precision="int8")
    app = config["applications"][0]
    assert app["deployments"] == [{"name": "engine", "num_replicas": 3,
                                   "max_ongoing_requests": 6}]  # fmt: skip
    assert app["args"] == {"model": "default", "precision": "int8", "max_batch_size": 8}
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(config))
    args = build_parser().parse_args(["serve", "--ray", "--config", str(path)])
    todo = plan(args)
    assert todo["engine"]["num_replicas"] == 3 and todo["engine"]["max_ongoing_requests"] == 6
    assert todo["options"]["precision"] == "int8" and todo["options"]["max_batch_size"] == 8
    report = {"knees": {"8 users": {"label": "x", "ray_serve": config}}, "best_for_slo": None}
    path.write_text(json.dumps(report))
    assert plan(args)["engine"]["num_replicas"] == 3


def test_replicas_autoscale_between_bounds_aiming_at_a_batch_each() -> None:
    from app.cli.main import build_parser
    from app.cli.serve_ray import plan

    args = build_parser().parse_args(
        ["serve", "--ray", "--autoscale", "1..3", "--max-batch-size", "8", "--max-waiting", "4"]
    )
    todo = plan(args)
    assert todo["engine"]["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8, "initial_replicas": 1,
    }  # fmt: skip
    assert "num_replicas" not in todo["engine"]
    assert todo["engine"]["ray_actor_options"] == {"num_cpus": 1.0}
    assert "ray" not in todo["options"] and todo["options"]["max_batch_size"] == 8


@pytest.mark.parametrize(
    ("flags", "says"),
    [(["--autoscale", "4..2"], "MIN <= MAX"), (["--autoscale", "two"], "MIN..MAX"),
     (["--replicas", "0"], "at least 1"), (["--config", "/nope.yaml"], "cannot read")],
)  # fmt: skip
def test_bad_replica_options_are_one_line(flags, says) -> None:
    from app.cli.main import build_parser
    from app.cli.serve_ray import plan

    with pytest.raises(InvalidRequestError, match=re.escape(says)):
        plan(build_parser().parse_args(["serve", "--ray", *flags]))


def test_bad_options_fail_before_ray_starts_and_a_replicas_failure_is_its_own_line(capsys):
    """A precision a replica would refuse is refused before Ray starts (a replica that fails
    to start is retried three times); a failure only a replica sees is read back from Ray
    Serve's status as the replica's own message, not Ray's 'failed to update'."""
    from types import SimpleNamespace

    from app.cli.main import main
    from app.cli.serve_ray import replica_failure

    started = time.monotonic()
    assert main(["serve", "--ray", "--precision", "int3", "--port", "0"]) == 2
    assert "unknown precision 'int3'" in capsys.readouterr().err
    assert time.monotonic() - started < 30
    traceback = (
        "The deployment failed to start 3 times in a row. Error:\n"
        'Traceback (most recent call last):\n  File "app/loading.py", line 1, in x\n'
        "engine.errors.ModelLoadError: no calibration 'self' for this model; run "
        "`infersight calibrate` first\n"
    )
    status = SimpleNamespace(applications={"infersight": SimpleNamespace(
        deployments={"engine": SimpleNamespace(message=traceback)})})  # fmt: skip
    fake = SimpleNamespace(status=lambda: status)
    assert replica_failure(fake) == (
        "no calibration 'self' for this model; run `infersight calibrate` first"
    )
    assert replica_failure(SimpleNamespace(status=lambda: 1 / 0)) == ""


def test_without_ray_installed_serve_ray_says_how_to_install_it(monkeypatch, capsys) -> None:
    import builtins

    from app.cli.main import main

    real = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    assert main(["serve", "--ray", "--model", "default"]) != 0
    err = capsys.readouterr().err
    assert "pip install 'infersight[ray]'" in err and "Traceback" not in err


# -- the command, on a local Ray instance -------------------------------------------------------

REPLICAS, BATCH, WAITING = 2, 2, 2


@pytest.fixture(scope="module")
def ray_root() -> Iterator[Path]:
    """Ray's files for this module's instance: every process of it names this folder in its
    command line, which is how the shutdown test finds any left behind. Short, as Ray's
    socket paths must be."""
    root = Path(tempfile.mkdtemp(prefix="isr-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def served(default_model: Path, ray_root: Path, tmp_path_factory) -> Iterator[dict[str, object]]:
    """``infersight serve --ray --replicas 2`` on a free port: its base URL and process."""
    from app.server.routes import bind

    with bind("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
    log = tmp_path_factory.mktemp("serve-ray") / "serve.log"
    out = open(log, "w", encoding="utf-8")  # noqa: SIM115 (closed at the end)
    env = {**os.environ, "RAY_TMPDIR": str(ray_root), "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--ray", "--replicas", str(REPLICAS),
         "--model", "default", "--port", str(port), "--max-batch-size", str(BATCH),
         "--max-waiting", str(WAITING), "--self-test-interval", "0", "--api-key", KEY],
        stdout=out, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while "serving on" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"serve --ray did not start:\n{log.read_text()}")
        time.sleep(0.5)
    yield {"base": base, "proc": proc, "log": log}
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)
    out.close()


def replicas(base: str) -> dict[str, dict[str, object]]:
    _, _, body = request(base, "GET", "/health", key=None)
    return json.loads(body)["replicas"]


def by_replica(base: str, name: str) -> dict[str, float]:
    """A metric's ``_total`` sample per replica."""
    _, _, body = request(base, "GET", "/metrics")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == name:
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0.0) + s.value
    return out


def settled(base: str, name: str, total: float) -> dict[str, float]:
    """:func:`by_replica` once its values add up to ``total`` (the replicas report each
    second), or as they stand after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        now = by_replica(base, name)
        if sum(now.values()) >= total or time.monotonic() > deadline:
            return now
        time.sleep(0.25)


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served['base']}/v1", api_key=KEY, max_retries=0,
                         timeout=120)  # fmt: skip


@pytest.fixture(scope="module")
def engine(default_model: Path) -> LLMEngine:
    return load_model(default_model)


def test_two_replicas_stream_what_one_engine_generates(served, client, engine) -> None:
    """Through Ray's proxy: the SDK's streams equal one engine's greedy text, chat and
    completion, and /v1/models, /health and /metrics answer, naming both replicas; the API
    key is asked of every route but /health, by the replicas and by the front's /metrics."""
    base = str(served["base"])
    for path in ("/v1/models", "/metrics"):
        status, _, body = request(base, "GET", path, key=None)
        assert status == 401 and b"invalid_api_key" in body, (path, status)
    assert [m.id for m in client.models.list().data] == [MODEL]
    deadline = time.monotonic() + 30
    while len(replicas(base)) < REPLICAS and time.monotonic() < deadline:
        time.sleep(0.5)
    health = replicas(base)
    assert len(health) == REPLICAS and all(h["status"] == "ok" for h in health.values())
    questions = ["Name three rivers in Europe.", "What is two plus two?", "Say hello.",
                 "Count to five."]  # fmt: skip
    texts: dict[str, str] = {}

    def chat(question: str) -> None:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=12,
            temperature=0, stream=True,
        )  # fmt: skip
        texts[question] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    for pair in (questions[:2], questions[2:]):  # two at a time: within one replica's queue
        threads = [threading.Thread(target=chat, args=(q,)) for q in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for question in questions:
        assert texts[question] == greedy(engine, question, 12)
    prompt = "The capital of France is"
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                       temperature=0, stream=True)  # fmt: skip
    text = "".join(c.choices[0].text for c in stream)
    want = engine.generate(engine.tokenizer.encode_prompt(prompt), engine_params(8))
    list(want)
    assert text == want.result.text
    done = settled(base, "vllm:request_success_total", len(questions) + 1)
    assert set(done) <= set(health) and sum(done.values()) >= len(questions) + 1


def test_a_shared_prefix_goes_to_the_replica_that_has_it_cached(served, client) -> None:
    """Requests with one long system prompt, one after another: the router sends every one
    after the first to the replica that served the first, whose prefix cache then hits."""
    base = str(served["base"])
    system = (
        "You are the assistant of a lighthouse keeper on a small northern island. "
        "You answer questions about the sea, the weather and the lamp briefly. "
    ) * 3
    before = by_replica(base, "vllm:request_success_total")
    hits_before = by_replica(base, "vllm:prefix_cache_hits_total")
    for question in ("Is a storm coming?", "When is high tide?", "Is the lamp lit?",
                     "How cold is the sea?"):  # fmt: skip
        client.chat.completions.create(
            model=MODEL, max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        )  # fmt: skip
    after = settled(base, "vllm:request_success_total", sum(before.values()) + 4)
    grew = {r: after.get(r, 0) - before.get(r, 0) for r in replicas(base)}
    assert sorted(grew.values()) == [0, 4], grew  # all four on one replica
    chosen = max(grew, key=lambda r: grew[r])
    hits = by_replica(base, "vllm:prefix_cache_hits_total")
    assert hits[chosen] - hits_before.get(chosen, 0) > 0


def test_a_burst_beyond_both_queues_gets_503_and_loses_no_accepted_request(served) -> None:
    base = str(served["base"])
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    results: list[tuple[int, dict[str, str], bytes]] = []

    def send() -> None:
        results.append(request(base, "POST", "/v1/completions", body))

    threads = [threading.Thread(target=send) for _ in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == 24
    busy = [r for r in results if r[0] == 503]
    ok = [json.loads(r[2]) for r in results if r[0] == 200]
    assert busy and ok and len(busy) + len(ok) == 24, [r[0] for r in results]
    assert all(h.get("retry-after") for _, h, _ in busy)
    deadline = time.monotonic() + 10  # both replicas took some (their reports come each second)
    while True:
        served = by_replica(base, "vllm:request_success_total")
        if len([n for n in served.values() if n > 0]) == REPLICAS or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert len([n for n in served.values() if n > 0]) == REPLICAS, served
    for reply in ok:  # each accepted request whole: its tokens counted, its finish given
        choice = reply["choices"][0]
        assert choice["finish_reason"] in ("length", "stop") and choice["text"]
        assert 0 < reply["usage"]["completion_tokens"] <= 24


def test_a_killed_replica_is_replaced_and_no_request_hangs(served, client) -> None:
    """Four long streams on the two replicas; one replica's process killed mid-reply: the
    streams on the other complete, the ones on it end with an error (none hangs, none ends
    looking complete), and Ray starts a replica in its place."""
    base = str(served["base"])
    before = replicas(base)
    outcomes: dict[int, str] = {}
    started = threading.Event()

    def stream(i: int) -> None:
        try:
            parts = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Story {i}: a long tale."}],
                max_tokens=120, temperature=0, stream=True,
            )  # fmt: skip
            finish = None
            for c in parts:
                started.set()
                if c.choices and c.choices[0].finish_reason:
                    finish = c.choices[0].finish_reason
            outcomes[i] = f"done:{finish}" if finish else "cut"
        except (openai.APIError, openai.APIConnectionError) as exc:
            outcomes[i] = f"error:{type(exc).__name__}"

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert started.wait(120)
    time.sleep(1.0)
    victim = next(iter(before.values()))
    os.kill(int(victim["pid"]), signal.SIGKILL)
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads)  # nothing hangs
    assert len(outcomes) == 4 and "cut" not in outcomes.values(), outcomes
    assert any(o.startswith("done") for o in outcomes.values()), outcomes
    assert any(o.startswith("error") for o in outcomes.values()), outcomes
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = replicas(base)
        if len(now) == REPLICAS and set(now) != set(before):
            break
        time.sleep(1.0)
    now = replicas(base)
    assert len(now) == REPLICAS and set(now) != set(before)  # a new replica took its place
    assert all(h["status"] == "ok" for h in now.values())


def test_ctrl_c_stops_every_ray_process_of_ours(served, ray_root: Path) -> None:
    proc = served["proc"]
    assert isinstance(proc, subprocess.Popen)
    ours = [p for p in psutil.process_iter(["cmdline"])
            if str(ray_root) in " ".join(p.info["cmdline"] or ())]  # fmt: skip
    assert len(ours) >= 3  # gcs, raylet, workers … of this instance, found by its folder
    proc.send_signal(signal.SIGINT)
    assert proc.wait(90) == 0
    assert "infersight serve --ray: stopped" in Path(str(served["log"])).read_text()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = [p for p in ours if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left:
            break
        time.sleep(0.5)
    assert not left, [p.info["cmdline"][:2] for p in left]
