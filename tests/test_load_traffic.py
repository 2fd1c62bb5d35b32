"""The load generator's traffic (:class:`engine.bench.load_spec.Traffic`,
:mod:`app.endpoints.traffic`): chat and completions, streamed and not, greedy and sampled,
with the soak's faults, against ``infersight serve`` in a child process — every request ends
the way its fault says, the server loses none and holds no KV block once idle — and against
servers that fail (tests/misbehaving.py): what ``lost`` and ``error_event`` mean."""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler
from typing import ClassVar

import pytest

from app.endpoints.client import Endpoint, with_model
from app.endpoints.load import OUTCOMES, ROOM, run_load, tokens_of
from engine.bench.load_spec import (
    FAULTS,
    STREAM_FAULTS,
    LoadSpec,
    PromptMix,
    Shape,
    Traffic,
    draw_request,
    draw_shape,
    prompt_set,
)
from engine.errors import InvalidRequestError
from tests.misbehaving import RIGHT, Quiet, misbehaving  # noqa: F401 (the fixture)
from tests.served import KEY, wait_idle

SHORT = PromptMix(documents=0.3, conversations=0.0, output_median=6, output_min=3, output_max=9)
#: how a request carrying each fault ends against a server that holds (serve: 1 MiB bodies,
#: a context far under 80k tokens)
EXPECTED = {"": "whole", "slow_reader": "whole", "disconnect": "cut", "cancel": "cut",
            "oversize_body": "refused", "over_context": "refused",
            "malformed": "refused"}  # fmt: skip


def test_traffic_reads_name_share_pairs_and_refuses_what_it_does_not_know():
    t = Traffic.parse("completions=0.5, sampled=0.25,cancel=0.1,disconnect=0.05")
    assert (t.completions, t.unstreamed, t.sampled, t.temperature) == (0.5, 0.0, 0.25, 0.8)
    assert t.faults == (("disconnect", 0.05), ("cancel", 0.1))  # in FAULTS' order
    assert Traffic.parse(t.describe()) == t and Traffic().describe() == ""
    for bad, said in [("stream=0.5", "the names completions"), ("cancel", "name=share"),
                      ("sampled=x", "name=share"), ("sampled=1.5", "sampled share"),
                      ("cancel=0.6,malformed=0.6", "sum to <= 1"),
                      ("temperature=3", "temperature")]:  # fmt: skip
        with pytest.raises(InvalidRequestError, match=said) as refused:
            Traffic.parse(bad)
        assert "\n" not in str(refused.value)
    with pytest.raises(InvalidRequestError, match="no fault 'crash'"):
        Traffic(faults=(("crash", 0.1),))


def test_shapes_are_drawn_in_their_shares_and_a_streams_fault_is_streamed():
    rng = random.Random(7)
    assert draw_shape(rng, Traffic()) == Shape()
    assert rng.random() == random.Random(7).random()  # the default takes no draw
    faults = (("disconnect", 0.1), ("cancel", 0.1), ("malformed", 0.1))
    traffic = Traffic(completions=0.3, unstreamed=0.6, sampled=0.4, faults=faults)
    n = 20_000
    shapes = [draw_shape(rng, traffic) for _ in range(n)]
    drawn = Counter(s.fault for s in shapes)

    def near(count: int, share: float) -> bool:  # within five binomial standard deviations
        return abs(count - n * share) <= 5 * (n * share * (1 - share)) ** 0.5

    assert set(drawn) == {"", "disconnect", "cancel", "malformed"}
    assert all(near(drawn[f], 0.1) for f in ("disconnect", "cancel", "malformed"))
    assert near(sum(s.route == "completions" for s in shapes), 0.3)
    assert near(sum(s.seed is not None for s in shapes), 0.4)
    assert all(s.stream for s in shapes if s.fault in STREAM_FAULTS)
    plain = [s for s in shapes if not s.fault]
    assert abs(sum(not s.stream for s in plain) / len(plain) - 0.6) < 0.03
    assert all(s.pause_s == 0 for s in shapes)  # no slow reader among these faults


def test_the_engines_own_load_refuses_traffic_by_name():
    from engine.bench.loadgen import LoadGenerator

    spec = LoadSpec(traffic=Traffic(sampled=0.5))
    with pytest.raises(InvalidRequestError, match=r"sampled=0\.5.*send it to one"):
        LoadGenerator(None, spec)  # type: ignore[arg-type]  # refused before the engine is read


class Capture(BaseHTTPRequestHandler):
    """Notes each request's route and body and answers one streamed word, or the JSON of a
    whole reply."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[tuple[str, dict[str, object]]]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        Capture.seen.append((self.path, body))
        end = {"index": 0, "finish_reason": "length", "text": "Blue",
               "message": {"role": "assistant", "content": "Blue"}}  # fmt: skip
        if body.get("stream"):
            chunk = {"choices": [{"index": 0, "delta": {"content": "Blue"}, "text": "Blue"}]}
            last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
            data = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(last)}\n\ndata: [DONE]\n\n"
            kind = "text/event-stream"
        else:
            data, kind = (
                json.dumps({"choices": [end], "usage": {"completion_tokens": 1}}),
                "application/json",
            )
        raw = data.encode()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


def test_what_each_shape_sends_and_a_default_load_sends_what_it_always_sent():
    httpd = Quiet(("127.0.0.1", 0), Capture)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    endpoint = Endpoint(f"http://127.0.0.1:{httpd.server_address[1]}", model="m")
    try:
        Capture.seen = []
        run_load(endpoint, LoadSpec(users=1, requests=3, seed=4, mix=SHORT))
        drawn = random.Random(4)
        for route, body in Capture.seen:  # streamed greedy chat, run to its length
            _, messages, out = draw_request(drawn, SHORT, prompt_set(), tokens_of, ROOM)
            assert route == "/v1/chat/completions"
            assert body == {"model": "m", "messages": messages, "max_tokens": out,
                            "temperature": 0.0, "stream": True, "ignore_eos": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
        Capture.seen = []
        traffic = Traffic(completions=1.0, unstreamed=1.0, sampled=1.0, temperature=0.5)
        run = run_load(endpoint, LoadSpec(users=1, requests=2, seed=4, mix=SHORT,
                                          traffic=traffic), ignore_eos=False)  # fmt: skip
        shapes = [r.shape for r in sorted(run.records, key=lambda r: r.sent)]
        for (route, body), shape in zip(Capture.seen, shapes, strict=True):
            assert route == "/v1/completions" and isinstance(body.pop("prompt"), str)
            assert body == {"model": "m", "max_tokens": body["max_tokens"], "temperature": 0.5,
                            "stream": False, "seed": shape.seed}  # fmt: skip
        assert [r.outcome for r in run.records] == ["whole", "whole"]
    finally:
        httpd.shutdown()


def test_every_kind_and_fault_against_serve_ends_as_it_should_and_loses_nothing(server):
    endpoint = with_model(Endpoint(server, api_key=KEY))
    traffic = Traffic(completions=0.5, unstreamed=0.5, sampled=0.5,
                      faults=tuple((f, 0.07) for f in FAULTS))  # fmt: skip
    spec = LoadSpec(mode="closed", users=3, requests=80, seed=5, mix=SHORT, traffic=traffic)
    run = run_load(endpoint, spec)
    records = run.records
    assert len(records) == 80 and not run.result.stopped
    seen = Counter((r.shape.fault, r.outcome) for r in records)
    assert {f for f, _ in seen} == {"", *FAULTS}  # every fault was sent
    assert {(f, o) for f, o in seen} == {(f, EXPECTED[f]) for f, _ in seen}, seen
    assert all(r.outcome in OUTCOMES and r.outcome != "lost" for r in records)
    # the refusals, by what each fault broke: a body past 1 MiB, past the context, not JSON
    status = {r.shape.fault: r.status for r in records if r.outcome == "refused"}
    assert status == {"oversize_body": 413, "over_context": 400, "malformed": 400}
    whole = [r for r in records if r.outcome == "whole"]
    # each kind of request was sent, and each whole one ran to its drawn length (ignore_eos)
    kinds = {(r.shape.route, r.shape.stream, r.shape.seed is not None) for r in whole}
    assert kinds == {(route, stream, sampled) for route in ("chat", "completions")
                     for stream in (True, False) for sampled in (True, False)}  # fmt: skip
    assert all(r.output_tokens == r.max_tokens for r in whole)
    assert all(r.time_to_first_token_seconds is not None for r in whole if r.shape.stream)
    assert all(r.time_to_first_token_seconds is None for r in whole if not r.shape.stream)
    # the cut requests were the server's to end: once idle, nothing runs and no block is held
    m = wait_idle(server)
    assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
    assert m["infersight:kv_blocks_used"] == 0


@pytest.mark.parametrize(
    ("model", "outcome"),
    [("fine", "whole"), ("error", "error_event"), ("drop", "lost"), ("shape", "lost"),
     ("strict", "lost")],  # a 400 without OpenAI's error shape: not a refusal said as one
)  # fmt: skip
def test_an_outcome_is_what_the_client_saw(misbehaving, model, outcome):  # noqa: F811
    spec = LoadSpec(mode="closed", users=1, requests=2, seed=0, mix=SHORT)
    run = run_load(Endpoint(misbehaving, model=model, api_key=RIGHT), spec)
    assert [r.outcome for r in run.records] == [outcome, outcome]


def test_tune_endpoint_sends_traffic_and_counts_how_each_request_ended(server, monkeypatch,
                                                                       capsys):  # fmt: skip
    from app.cli.main import main
    from app.endpoints import keys

    monkeypatch.setenv(keys.ENV, KEY)
    args = ["tune", "--endpoint", server, "--users", "2", "--requests", "8",
            "--output-median", "4", "--output-max", "6", "--seed", "3",
            "--traffic", "completions=0.5,unstreamed=0.5,cancel=0.25,malformed=0.25",
            "--json"]  # fmt: skip
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["traffic"] == "completions=0.5,unstreamed=0.5,cancel=0.25,malformed=0.25"
    ended = report["outcomes"]["2 users"]
    assert sum(ended.values()) == 8 and set(ended) <= {"none/whole", "cancel/cut",
                                                        "malformed/refused"}  # fmt: skip
    assert report["points"][0]["failed"] == ended.get("malformed/refused", 0)
    for bad, said in [(["--endpoint", server, "--traffic", "crash=1"], "the names completions"),
                      (["--traffic", "sampled=0.5"], "give --endpoint URL too")]:  # fmt: skip
        assert main(["tune", "--requests", "1", *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
