"""OpenAI-compatible servers as models (app/endpoints): the client against ``infersight serve``
in a child process (tests/served.py), with the openai SDK as the oracle of what the server
said, and against a server written here that fails as servers fail users: a key refused, a
rate limit with Retry-After, a stream dropped mid-reply, nothing sent before the timeout, an
event that is not JSON, nobody listening."""

from __future__ import annotations

import itertools
import json
import math
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import ClassVar

import pytest

from app.endpoints import keys
from app.endpoints.client import Endpoint, EndpointError, Streamed, models, stream_chat, with_model
from app.endpoints.load import ROOM, run_load
from engine.bench.load_spec import SLO, LoadSpec, PromptMix, draw_request, prompt_set
from tests.misbehaving import RIGHT, Quiet
from tests.served import KEY

HELLO = [{"role": "user", "content": "Name three colours."}]


def test_the_served_models_and_a_streamed_greedy_reply_are_what_the_sdk_gets(server, client):
    endpoint = with_model(Endpoint(server, api_key=KEY))
    assert endpoint.model in models(endpoint) and endpoint.model
    reply = Streamed(0.0)
    chunks = list(stream_chat(endpoint, HELLO, max_tokens=12, top_logprobs=3, reply=reply))
    oracle = client.chat.completions.create(
        model=endpoint.model, messages=HELLO, max_tokens=12, temperature=0.0
    )
    assert reply.text == oracle.choices[0].message.content and reply.text
    assert reply.tokens == oracle.usage.completion_tokens == 12
    assert reply.finish_reason == "length"
    # every token scored, with up to three alternatives, its own among them where it ranks
    scored = [t for c in chunks for t in c.tokens]
    assert len(scored) == 12 and "".join(t.token for t in scored) == reply.text
    for t in scored:
        assert t.logprob <= 0 and 1 <= len(t.top) <= 3
        assert t.top == tuple(sorted(t.top, key=lambda a: -a[1]))
        assert t.logprob >= t.top[-1][1] - 1e-6  # greedy: never below the k-th alternative
    # the client's clock: the first token after sending, the rest after it, in order
    assert all(a.at <= b.at for a, b in itertools.pairwise(chunks))
    assert reply.ttft_s is not None and reply.ttft_s > 0
    assert reply.tpot_s is not None and reply.tpot_s > 0


def test_a_stop_closes_the_stream_and_the_server_serves_on(server):
    endpoint = with_model(Endpoint(server, api_key=KEY))
    stream = stream_chat(endpoint, HELLO, max_tokens=200)
    first = next(stream)
    stream.close()  # the user pressed stop
    assert first.text
    again = Streamed(0.0)
    list(stream_chat(endpoint, HELLO, max_tokens=3, reply=again))
    assert again.tokens == 3


def test_a_wrong_key_and_a_model_gone_are_one_line_each(server):
    with pytest.raises(EndpointError, match="refused the API key") as refused:
        models(Endpoint(server, api_key="not-the-key"))
    assert refused.value.kind == "auth"
    gone = Endpoint(server, model="no-such-model", api_key=KEY)
    with pytest.raises(EndpointError, match="no no-such-model model") as missing:
        list(stream_chat(gone, HELLO, max_tokens=2))
    assert missing.value.kind == "model" and "\n" not in str(missing.value)


def _chat(base: str, model: str, **kw: object) -> Streamed:
    reply = Streamed(0.0)
    endpoint = Endpoint(base, model=model, api_key=RIGHT, **kw)  # type: ignore[arg-type]
    for _ in stream_chat(endpoint, HELLO, max_tokens=4, reply=reply):
        pass
    return reply


def test_the_models_a_server_lists_and_a_reply_that_ends(misbehaving):
    assert models(Endpoint(misbehaving + "/v1/", api_key=RIGHT)) == [
        "drop", "busy", "slow", "garbage"]  # fmt: skip
    assert with_model(Endpoint(misbehaving, api_key=RIGHT)).model == "drop"
    assert _chat(misbehaving, "fine").text == "Blue"


def test_a_dropped_stream_keeps_what_came(misbehaving):
    reply = Streamed(0.0)
    with pytest.raises(EndpointError, match="ended the stream after 2 chunks") as dropped:
        for _ in stream_chat(Endpoint(misbehaving, model="drop", api_key=RIGHT), HELLO,
                             max_tokens=4, reply=reply):  # fmt: skip
            pass
    assert dropped.value.kind == "dropped" and reply.text == "Red green"


def test_a_rate_limit_says_how_long_to_wait(misbehaving):
    with pytest.raises(EndpointError, match=r"limiting requests \(HTTP 429: slow down\); "
                       "retry after 3 s") as limited:  # fmt: skip
        _chat(misbehaving, "busy")
    assert limited.value.kind == "rate_limited" and limited.value.retry_after == 3


def test_nothing_before_the_timeout_and_an_event_that_is_not_json(misbehaving):
    with pytest.raises(EndpointError, match=r"sent nothing for 0\.5 s") as stalled:
        _chat(misbehaving, "slow", read_s=0.5)
    assert stalled.value.kind == "timeout"
    with pytest.raises(EndpointError, match="not JSON") as garbage:
        _chat(misbehaving, "garbage")
    assert garbage.value.kind == "protocol"


def test_a_wrong_key_and_nobody_listening(misbehaving):
    with pytest.raises(EndpointError, match=r"refused the API key \(HTTP 401: invalid api key\)"):
        models(Endpoint(misbehaving, api_key="wrong"))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(EndpointError, match="is unreachable") as nobody:
        models(Endpoint(f"http://127.0.0.1:{port}", connect_s=2))
    assert nobody.value.kind == "unreachable"


def test_keys_live_in_the_keyring_per_server_and_the_environment_overrides(monkeypatch):
    import keyring

    from tests.memory_keyring import MemoryKeyring

    monkeypatch.delenv(keys.ENV, raising=False)
    previous = keyring.get_keyring()
    keyring.set_keyring(MemoryKeyring())
    try:
        keys.save_key("http://gpu-box:8000/v1/", "sk-1")
        assert keys.key("http://gpu-box:8000") == "sk-1"  # one entry per server
        assert keys.key("http://other:8000") is None
        monkeypatch.setenv(keys.ENV, "from-env")
        assert keys.key("http://other:8000") == "from-env"
        monkeypatch.delenv(keys.ENV)
        keys.save_key("http://gpu-box:8000", None)
        assert keys.key("http://gpu-box:8000/v1") is None
        keys.save_key("http://gpu-box:8000", None)  # forgetting twice is no error
    finally:
        keyring.set_keyring(previous)


# -- the tuner's load against a server ------------------------------------------------------------

SHORT = PromptMix(documents=0.0, conversations=0.0, output_median=6, output_min=3, output_max=9)


def _drawn_outputs(spec: LoadSpec) -> list[int]:
    """The output lengths ``spec``'s requests draw: the same draws the run makes."""
    rng, texts = random.Random(spec.seed), prompt_set()
    count = spec.requests or 0
    return [draw_request(rng, spec.mix, texts, lambda t: max(1, len(t) // 4), ROOM)[2]
            for _ in range(count)]  # fmt: skip


def test_a_closed_loop_against_the_server_runs_every_request_to_its_length(server):
    endpoint = with_model(Endpoint(server, api_key=KEY))
    spec = LoadSpec(mode="closed", users=2, requests=5, seed=3, mix=SHORT)
    run = run_load(endpoint, spec, SLO(ttft_s=60.0, tpot_s=60.0))
    r = run.result
    assert (r.completed, r.failed, not run.failures) == (5, 0, True)
    assert r.total_output_tokens == sum(_drawn_outputs(spec))  # ignore_eos: every token
    assert r.total_input_tokens > 0 and r.request_throughput > 0
    assert 0 < r.ttft_ms["median"] <= r.e2el_ms["median"] and r.tpot_ms["median"] > 0
    assert r.slo_attainment == 1.0 and r.load == "2 users"
    assert math.isnan(r.queue_ms["median"])  # what only the server's engine sees


def test_an_open_loop_spaces_its_arrivals(server):
    endpoint = with_model(Endpoint(server, api_key=KEY))
    spec = LoadSpec(mode="constant", rate=5.0, requests=3, seed=1, mix=SHORT)
    run = run_load(endpoint, spec)
    assert run.result.completed == 3
    records = sorted(run.records, key=lambda r: r.sent)
    dues = [r.due for r in records]
    assert dues == sorted(dues) and None not in dues
    assert all(abs(b - a - 0.2) < 1e-6 for a, b in itertools.pairwise(dues))  # 1/5 s apart
    assert all(r.due <= r.sent < r.due + 0.15 for r in records)  # sent when due, not later


def test_a_failing_server_marks_the_run_with_how_it_failed(misbehaving):
    spec = LoadSpec(mode="closed", users=2, requests=4, seed=0, mix=SHORT)
    busy = run_load(Endpoint(misbehaving, model="busy", api_key=RIGHT), spec)
    assert busy.result.completed == 0 and busy.failures == {"rate_limited": 4}
    assert busy.result.refused == 4 and "retry after 3 s" in busy.first_failure["rate_limited"]
    stop = threading.Event()
    stop.set()  # a stop before anything is sent: nothing is
    assert run_load(Endpoint(misbehaving, model="busy", api_key=RIGHT), spec,
                    stop=stop).result.stopped  # fmt: skip
    dropped = run_load(Endpoint(misbehaving, model="drop", api_key=RIGHT), spec)
    assert dropped.failures == {"dropped": 4} and dropped.result.failed == 4
    shaped = run_load(Endpoint(misbehaving, model="shape", api_key=RIGHT), spec)
    assert shaped.failures == {"protocol": 4}  # a chunk of another shape: no thread lost
    # a key refused heals with no wait: the run ends at the first failures
    refused = run_load(Endpoint(misbehaving, model="fine", api_key="wrong"), spec)
    assert refused.result.stopped and set(refused.failures) == {"auth"}
    assert refused.result.failed <= spec.users < spec.requests


def test_a_stop_ends_the_requests_in_flight(misbehaving):
    spec = LoadSpec(mode="closed", users=2, requests=2, seed=0, mix=SHORT)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    began = time.perf_counter()
    run = run_load(Endpoint(misbehaving, model="long", api_key=RIGHT), spec, stop=stop)
    assert time.perf_counter() - began < 3.0  # the replies take 10 s each
    assert run.result.stopped and run.result.completed == 0  # cut where they were:
    assert all(r.cut and r.output_tokens > 0 for r in run.records)  # not done, not failed
    assert run.result.failed == 0


def test_tune_endpoint_sweeps_a_server_headless(server, monkeypatch, capsys):
    from app.cli.main import main

    monkeypatch.setenv(keys.ENV, KEY)
    args = ["tune", "--endpoint", server, "--users", "1", "2", "--requests", "2",
            "--output-median", "4", "--output-max", "6", "--documents", "0",
            "--conversations", "0", "--slo", "ttft=60s,tpot=60s", "--json"]  # fmt: skip
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["endpoint"].endswith(server) and report["failures"] == {}
    points = report["points"]
    assert [p["load"] for p in points] == ["1 users", "2 users"]
    assert all(p["completed"] == 2 and p["failed"] == 0 for p in points)
    assert report["best_for_slo"] in ("1 users", "2 users")


def test_tune_endpoint_says_in_one_line_that_nobody_listens(capsys, monkeypatch):
    from app.cli.main import main

    monkeypatch.setenv(keys.ENV, "any")  # not the machine's keyring
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["tune", "--endpoint", f"http://127.0.0.1:{port}", "--requests", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is unreachable" in err[0] and "Traceback" not in err[0]


def test_a_server_that_refuses_ignore_eos_is_loaded_without_it(misbehaving, monkeypatch, capsys):
    from app.cli.main import main

    spec = LoadSpec(mode="closed", users=1, requests=2, seed=0, mix=SHORT)
    strict = Endpoint(misbehaving, model="strict", api_key=RIGHT)
    refused = run_load(strict, spec)
    assert refused.failures == {"refused": 2} and "ignore_eos" in refused.first_failure["refused"]
    assert run_load(strict, spec, ignore_eos=False).result.completed == 2
    monkeypatch.setenv(keys.ENV, RIGHT)
    args = ["tune", "--endpoint", misbehaving, "--endpoint-model", "strict", "--endpoint-eos",
            "--requests", "2", "--users", "1", "--json"]  # fmt: skip
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["failures"] == {} and report["points"][0]["completed"] == 2


class KeepAlive(BaseHTTPRequestHandler):
    """A server that keeps its connections alive (HTTP/1.1) and notes each request's client
    port: how many connections a load opened."""

    protocol_version = "HTTP/1.1"
    ports: ClassVar[list[int]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        KeepAlive.ports.append(self.client_address[1])
        event = {"choices": [{"index": 0, "delta": {"content": "Blue"}}]}
        body = f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_load_shares_its_connections_between_a_users_requests():
    """One client per run: a closed loop's user sends its requests on one kept-alive
    connection, so that a TTFT holds no connection's setup after the first."""
    httpd = Quiet(("127.0.0.1", 0), KeepAlive)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        KeepAlive.ports = []
        run = run_load(Endpoint(base, model="m"), LoadSpec(users=1, requests=4, mix=SHORT))
        assert run.result.completed == 4 and len(set(KeepAlive.ports)) == 1
        KeepAlive.ports = []
        run = run_load(Endpoint(base, model="m"), LoadSpec(users=2, requests=6, mix=SHORT))
        assert run.result.completed == 6 and len(set(KeepAlive.ports)) <= 2
    finally:
        httpd.shutdown()
