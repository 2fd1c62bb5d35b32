"""The soak's traffic: one request at a time per client thread, drawn from a seeded mix —
chat and completions, streamed and not, greedy and sampled, many behind a shared long system
prompt (the prefix cache's work) — with faults injected at a fixed rate: a client that hangs
up mid-stream, one that hangs up before the first byte (a cancel), one that reads slowly, a
body over the server's limit, a prompt far over the model's context, a body that is not JSON.

Each request ends in one :data:`OUTCOMES` kind, by what the client saw. ``lost`` is the one
that must never happen: a request the server accepted (200) that ended neither whole nor with
an error event naming why, and the client did not cut it; a 5xx counts there too."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import httpx2

#: how a request ended, as the client saw it
OUTCOMES = ("whole", "error_event", "refused", "cut", "lost")
#: the faults, each at this share of the requests (the rest are plain)
FAULTS = {"disconnect": 0.06, "cancel": 0.04, "slow_reader": 0.05, "oversize_body": 0.02,
          "over_context": 0.02, "malformed": 0.03}  # fmt: skip
SYSTEMS = [  # shared prefixes: long system prompts many requests begin with
    "You are a careful assistant for a hardware shop. " * 20,
    "You answer questions about the history of computing, briefly and exactly. " * 18,
    "You are a patient tutor of elementary physics; explain step by step. " * 19,
]
QUESTIONS = ["Name three colours.", "What is a KV cache?", "Count from one to ten.",
             "Why is the sky blue?", "Write a haiku about rain.", "What is 17 times 23?",
             "Give two uses of a paper clip.", "Summarise what a compiler does."]  # fmt: skip


@dataclass(slots=True)
class Outcome:
    """One request: its kind of traffic and fault, how it ended, its client-side times."""

    kind: str
    fault: str
    outcome: str
    status: int
    ended: float  # time.perf_counter()
    ttft_s: float | None = None
    tpot_s: float | None = None
    detail: str = ""


def draw(rng: random.Random) -> tuple[str, str, dict[str, object]]:
    """The next request: its route, its fault ("" none) and its body."""
    fault = ""
    roll = rng.random()
    for name, share in FAULTS.items():
        if roll < share:
            fault = name
            break
        roll -= share
    stream = fault in ("disconnect", "cancel", "slow_reader") or rng.random() < 0.6
    sampled = rng.random() < 0.4
    body: dict[str, object] = {
        "max_tokens": rng.randint(8, 48), "stream": stream,
        "temperature": 0.8 if sampled else 0.0,
        **({"seed": rng.randint(0, 1 << 20)} if sampled else {}),
    }  # fmt: skip
    question = rng.choice(QUESTIONS)
    if rng.random() < 0.5:
        route = "/v1/chat/completions"
        messages = [{"role": "user", "content": question}]
        if rng.random() < 0.7:  # most behind a shared prefix
            messages.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
        body["messages"] = messages
    else:
        route = "/v1/completions"
        body["prompt"] = rng.choice(SYSTEMS) + "\nQ: " + question + "\nA:"
    if fault == "over_context":
        body.pop("messages", None)
        route, body["prompt"] = "/v1/completions", "lorem ipsum " * 40_000  # ~80k tokens
    if fault == "oversize_body":
        body.pop("messages", None)
        route, body["prompt"] = "/v1/completions", "x" * (2 << 20)  # over the 1 MiB limit
    return route, fault, body


def send(client: httpx2.Client, base: str, key: str, model: str, route: str, fault: str,
         body: dict[str, object], rng: random.Random) -> Outcome:  # fmt: skip
    """Send one request and classify how it ended."""
    body = {**body, "model": model}
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    kind = f"{route.rsplit('/', 1)[-1]}{'+stream' if body.get('stream') else ''}"
    data = b'{"model": "' + model.encode() + b'", "messages": [' if fault == "malformed" \
        else json.dumps(body).encode()  # fmt: skip
    started = time.perf_counter()
    try:
        with client.stream("POST", base + route, content=data, headers=headers) as response:
            if response.status_code != 200:
                response.read()
                return _refusal(kind, fault, response)
            if fault == "cancel":  # hang up before reading a byte of the answer
                return Outcome(kind, fault, "cut", 200, time.perf_counter())
            if not body.get("stream"):
                return _whole(kind, fault, response.read(), started)
            return _stream(kind, fault, response, started, rng)
    except httpx2.HTTPError as exc:  # the server hung up, or never answered
        return Outcome(kind, fault, "lost", 0, time.perf_counter(), detail=repr(exc)[:200])


def _refusal(kind: str, fault: str, response: httpx2.Response) -> Outcome:
    """A 4xx with OpenAI's error shape is a refusal (expected of a fault, else said); a 5xx,
    or a 4xx without the shape, is lost."""
    status = response.status_code
    try:
        error = response.json().get("error", {})
        shaped = isinstance(error.get("message"), str) and isinstance(error.get("type"), str)
    except (ValueError, AttributeError):
        shaped = False
    outcome = "refused" if 400 <= status < 500 and shaped else "lost"
    return Outcome(kind, fault, outcome, status, time.perf_counter(),
                   detail=response.text[:200])  # fmt: skip


def _whole(kind: str, fault: str, raw: bytes, started: float) -> Outcome:
    ended = time.perf_counter()
    try:
        choices = json.loads(raw)["choices"]
        finished = all(c.get("finish_reason") in ("stop", "length") for c in choices)
    except (ValueError, KeyError, TypeError, AttributeError):
        finished = False
    detail = "" if finished else raw[:200].decode("utf-8", "replace")
    return Outcome(kind, fault, "whole" if finished else "lost", 200, ended,
                   ttft_s=ended - started, detail=detail)  # fmt: skip


def _stream(kind: str, fault: str, response: httpx2.Response, started: float,
            rng: random.Random) -> Outcome:  # fmt: skip
    """Read a stream to its end (slowly for a slow reader; two chunks for a disconnect)."""
    chunks, first, finish, error = 0, None, None, ""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            error = str(event["error"].get("message", "error"))
            break
        for choice in event.get("choices") or ():
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
        chunks += 1
        if first is None:
            first = time.perf_counter()
        if fault == "disconnect" and chunks >= 2:
            return Outcome(kind, fault, "cut", 200, time.perf_counter())
        if fault == "slow_reader":
            time.sleep(rng.uniform(0.05, 0.25))
    ended = time.perf_counter()
    ttft = None if first is None else first - started
    tpot = None if first is None or chunks < 2 else (ended - first) / (chunks - 1)
    if error:
        return Outcome(kind, fault, "error_event", 200, ended, ttft, tpot, detail=error)
    outcome = "whole" if finish in ("stop", "length") else "lost"
    return Outcome(kind, fault, outcome, 200, ended, ttft, tpot,
                   detail="" if outcome == "whole" else f"ended after {chunks} chunks")  # fmt: skip
