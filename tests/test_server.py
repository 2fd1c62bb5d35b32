"""``infersight serve`` as a user runs it: a subprocess on a free loopback port, spoken to with
the real ``openai`` SDK and, where the SDK hides the wire (``[DONE]``, headers, a client that
vanishes), with raw HTTP."""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.loader.load import load_model
from tests.served import KEY, MAX_N, MAX_TOKENS, MAX_WAITING, metrics, request, wait_idle


@pytest.fixture(scope="module")
def engine(default_model: Path) -> LLMEngine:
    return load_model(default_model)


def greedy(engine: LLMEngine, content: str, tokens: int) -> str:
    prompt = engine.chat_prompt_ids([{"role": "user", "content": content}])
    gen = engine.generate(prompt, SamplingParams(max_new_tokens=tokens))
    list(gen)
    return gen.result.text


def test_chat_streams_what_the_engine_generates_chunk_by_chunk(client, engine):
    question = "Name three rivers in Europe."
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}],
        max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    *content, usage = chunks
    assert usage.choices == [] and usage.usage is not None
    assert content[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in content]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == greedy(engine, question, 12)
    assert usage.usage.completion_tokens <= 12
    assert usage.usage.total_tokens == usage.usage.prompt_tokens + usage.usage.completion_tokens
    whole = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}],
        max_completion_tokens=12, temperature=0,
    )  # fmt: skip
    assert whole.choices[0].message.content == text
    assert whole.usage is not None
    assert whole.usage.completion_tokens == usage.usage.completion_tokens


def test_completions_stop_strings_n_and_seeds(client, engine):
    prompt = "The days of the week are Monday, Tuesday,"
    whole = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=20, temperature=0, stop=["Friday"]
    )
    text = whole.choices[0].text
    assert "Friday" not in text and whole.choices[0].finish_reason == "stop", text
    streamed = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=20, temperature=0,
        stop=["Friday"], stream=True,
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == text
    listed = client.completions.create(  # one prompt in a list, as LangChain sends it
        model="SmolLM2-135M-Instruct", prompt=[prompt], max_tokens=20, temperature=0,
        stop=["Friday"],
    )  # fmt: skip
    assert listed.choices[0].text == text
    ids = engine.tokenizer.encode_prompt(prompt)
    gen = engine.generate(ids, SamplingParams(max_new_tokens=20, stop=("Friday",)))
    list(gen)
    assert gen.result.text == text

    def sample() -> list[str]:
        out = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "A color?"}],
            max_tokens=8, temperature=1.0, seed=7, n=3,
        )  # fmt: skip
        assert [c.index for c in out.choices] == [0, 1, 2]
        return [c.message.content or "" for c in out.choices]

    first = sample()
    assert sample() == first  # a seed makes n choices reproducible


def test_logprobs_are_the_models_own_and_name_the_chosen_tokens(client, engine):
    import torch

    question = "What is 2 + 2?"
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}],
        max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.logprobs is not None and out.usage is not None
    entries = choice.logprobs.content or []
    assert len(entries) == out.usage.completion_tokens
    for e in entries:  # greedy: the chosen token is the likeliest one
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(tops[0])
    assert "".join(e.token for e in entries) == choice.message.content
    # the first one is the log-softmax of the model's logits after the prompt
    prompt = engine.chat_prompt_ids([{"role": "user", "content": question}])
    logits = engine.runner.forward_logits(prompt, engine.runner.new_cache(len(prompt)), 0)[-1]
    assert entries[0].logprob == pytest.approx(float(torch.log_softmax(logits, -1).max()), abs=1e-4)

    text = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="One, two, three,", max_tokens=4, temperature=0,
        logprobs=2, stream=True,
    )  # fmt: skip
    chunks = [c.choices[0] for c in text if c.choices]
    scored = [c.logprobs for c in chunks if c.logprobs is not None]
    assert len(scored) == 4
    offsets = [lp.text_offset[0] for lp in scored]
    lengths = [len(lp.tokens[0]) for lp in scored]
    assert offsets == [sum(lengths[:i]) for i in range(4)]
    assert all(len(lp.top_logprobs[0]) == 2 for lp in scored)


def test_the_stream_ends_with_done_as_server_sent_events(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    status, headers, data = request(server, "POST", "/v1/chat/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in data.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    json.loads(events[-2].removeprefix("data: "))


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": MAX_N + 1}, "n"),
        ({"max_tokens": MAX_TOKENS + 1}, "max_tokens"),
        ({"model": "gpt-4"}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "word " * 9000}]}, "messages"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_bad_fields_are_400_naming_the_field(server, change, param):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **change}
    status, _, data = request(server, "POST", "/v1/chat/completions", body)
    error = json.loads(data)["error"]
    assert status == 400, data
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"]


def test_a_key_is_needed_and_the_body_is_bounded(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    status, _, data = request(server, "POST", "/v1/chat/completions", body, key=None)
    assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"
    status, _, _ = request(server, "GET", "/v1/models", key="wrong")
    assert status == 401
    status, _, data = request(server, "GET", "/health", key=None)  # health needs no key
    health = json.loads(data)
    assert status == 200 and health["status"] == "ok" and not health["problems"]
    assert health["self_test"]["ok"] and health["self_test"]["answer"]  # run at start
    assert health["memory"]["ok"] and health["memory"]["total_bytes"] > 0
    status, _, data = request(server, "POST", "/v1/chat/completions", raw=b"x" * (2 << 20))
    assert status == 413 and "larger than" in json.loads(data)["error"]["message"]
    # the same without a Content-Length (chunked), and a small chunked body still works
    host, port = server.removeprefix("http://").split(":")
    for chunks, want in (([b"x" * (1 << 16)] * 40, 413), ([json.dumps(body).encode()], 200)):
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        conn.request("POST", "/v1/chat/completions", body=iter(chunks), encode_chunked=True,
                     headers={"Authorization": f"Bearer {KEY}",
                              "Content-Type": "application/json"})  # fmt: skip
        assert conn.getresponse().status == want
        conn.close()


def test_metrics_parse_and_count_the_finished_requests(server, client):
    before = wait_idle(server)  # whatever earlier tests sent has ended and is counted
    tokens = 0
    for i in range(3):
        done = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=f"Count: {i}", max_tokens=3, temperature=0
        )
        assert done.usage is not None
        tokens += done.usage.completion_tokens
    assert tokens == 9
    # a request is counted as it ends, before its answer is sent: at once
    now = metrics(server)
    ttft = "vllm:time_to_first_token_seconds_count"
    ended = "vllm:request_success_total{finished_reason=length}"
    assert now[ttft] - before.get(ttft, 0) == 3
    assert now[ended] - before.get(ended, 0) == 3
    per_request = "vllm:request_generation_tokens_sum"
    assert now[per_request] - before.get(per_request, 0) == tokens
    # the engine's own token count comes with its next snapshot (a quarter second apart)
    generated = "vllm:generation_tokens_total"
    deadline = time.monotonic() + 30
    while (after := metrics(server))[generated] - before[generated] < tokens:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert after[generated] - before[generated] == tokens
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total"):  # fmt: skip
        assert name in after


def test_a_client_that_disconnects_cancels_its_request(server):
    cancelled = "vllm:request_success_total{finished_reason=abort}"  # vLLM's label
    before = metrics(server).get(cancelled, 0)
    host, port = server.removeprefix("http://").split(":")
    cases = [
        ("Write a very long story about the sea.", True, True),  # mid-stream
        ("word " * 3000, True, False),  # mid-prefill: gone before its first token
        ("Write a very long poem about the wind.", False, False),  # waiting for a whole answer
    ]
    for content, stream, read in cases:
        # each alone: "the engine has it" below then means this one, and the last one runs
        # (its tokens come faster than the server's checks' tenth of a second) when its client
        # goes, rather than wait behind the long prompt's prefill
        wait_idle(server)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 400,
                "stream": stream}  # fmt: skip
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )
        if read:
            resp = conn.getresponse()
            for _ in range(4):
                assert resp.fp.readline()
        else:  # gone once the engine has it, before any token
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                m = metrics(server)
                if m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] > 0:
                    break
                time.sleep(0.02)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    m = wait_idle(server)
    assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0
    assert m[cancelled] - before == len(cases)
    # the blocks themselves: none held, the pool whole, what is kept a reusable prefix
    assert m["infersight:kv_blocks_used"] == 0 and m["infersight:kv_blocks_total"] > 0
    assert 0 <= m["infersight:kv_blocks_cached"] <= m["infersight:kv_blocks_total"]


def test_a_burst_beyond_the_queue_gets_503_and_loses_no_accepted_request(server, engine):
    """Twice the queue's clients at once: the first are accepted and all finish with the
    engine's text, the rest get 503 with Retry-After."""
    question = "What is the capital of Italy?"
    want = greedy(engine, question, 4)
    results: list[tuple[int, dict[str, str], bytes]] = []
    lock = threading.Lock()
    clients = 2 * MAX_WAITING
    go = threading.Barrier(clients)

    def one() -> None:
        body = {"messages": [{"role": "user", "content": question}], "max_tokens": 4,
                "temperature": 0}  # fmt: skip
        go.wait()
        out = request(server, "POST", "/v1/chat/completions", body)
        with lock:
            results.append(out)

    threads = [threading.Thread(target=one) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    ok = [json.loads(b) for s, _, b in results if s == 200]
    busy = [(h, json.loads(b)) for s, h, b in results if s == 503]
    assert len(ok) + len(busy) == clients
    assert MAX_WAITING <= len(ok) < clients and busy
    assert all(r["choices"][0]["message"]["content"] == want for r in ok)
    assert all(h["retry-after"] and e["error"]["code"] == "server_busy" for h, e in busy)
    m = wait_idle(server)
    assert m["vllm:kv_cache_usage_perc"] == 0
    assert m["infersight:rejected_requests_total{status=503}"] >= len(busy)


def test_the_log_is_json_lines_following_each_request_and_never_the_key(client, server_log):
    client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Log me", max_tokens=2, temperature=0
    )
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="x", temperature=9)
    deadline = time.monotonic() + 30
    while True:  # the end line is written by the engine's thread
        text = server_log.read_text()
        text = text[: text.rfind("\n") + 1]  # whole lines only
        lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        arrival = next(e for e in reversed(lines) if e["event"] == "arrival")
        ends = [e for e in lines if e["event"] == "end" and e["request_id"].startswith(
            arrival["request_id"])]  # fmt: skip
        if ends or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert KEY not in server_log.read_text()
    assert arrival["prompt_tokens"] > 0 and arrival["route"] == "/v1/completions"
    (end,) = ends
    assert end["output_tokens"] == 2 and end["ttft_s"] > 0 and "text" not in end
    (first,) = [e for e in lines if e["event"] == "first_token"
                and e["request_id"] == end["request_id"]]  # fmt: skip
    assert first["ttft_s"] == end["ttft_s"] and first["queue_s"] >= 0
    refused = next(e for e in reversed(lines) if e["event"] == "refused")
    assert refused["status"] == 400 and refused["param"] == "temperature"
    assert json.loads(refused["body"])["temperature"] == 9  # a failure logs its context


def test_64_streaming_clients_of_mixed_lengths_all_get_their_text(server, client, engine):
    questions = [f"Tell me one fact about the number {i}." for i in range(8)]
    lengths = [2 + i % 4 for i in range(8)]  # 2 … 5 new tokens
    want = {i: greedy(engine, questions[i], lengths[i]) for i in range(8)}
    got: dict[int, list[str]] = {i: [] for i in range(8)}
    lock = threading.Lock()
    wide = openai.OpenAI(base_url=str(client.base_url), api_key=KEY, max_retries=0, timeout=300)

    def one(k: int) -> None:
        i = k % 8
        stream = wide.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": questions[i]}],
            max_tokens=lengths[i], temperature=0, stream=True,
        )  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        with lock:
            got[i].append(text)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert {i: len(v) for i, v in got.items()} == dict.fromkeys(range(8), 8)
    assert all(text == want[i] for i, texts in got.items() for text in texts)
    assert wait_idle(server)["vllm:kv_cache_usage_perc"] == 0


def test_ctrl_c_stops_the_server_cleanly(tiny_model_dir, tmp_path) -> None:
    """Ctrl+C (SIGINT) shuts the server down as SIGTERM does, then exits 0: no traceback on
    the terminal (uvicorn raises the signal again after its shutdown, and asyncio's runner
    would turn that into a KeyboardInterrupt and a logged cancellation)."""
    import signal

    folder, _ = tiny_model_dir("llama", False)
    log_path = tmp_path / "serve.log"
    with open(log_path, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--model", str(folder), "--port", "0",
             "--self-test-interval", "0"],
            stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while True:
                named = re.search(r" on (http://127\.0\.0\.1:\d+)/v1", log_path.read_text())
                try:
                    if named and request(named.group(1), "GET", "/health", key=None)[0] == 200:
                        break
                except OSError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 0
        finally:
            proc.kill()
    text = log_path.read_text()
    assert "infersight serve: stopped" in text and "Traceback" not in text, text[-3000:]
