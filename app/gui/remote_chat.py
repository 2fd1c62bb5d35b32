"""The chat with a model another server runs: the model picker's endpoint page chooses it,
and from then on the chat's replies (:class:`Send`, :class:`Cancel`, Regenerate) go to that
OpenAI-compatible server instead of the worker, streamed in threads of their own and handed
to the chat as the worker hands its own (:class:`Delta`, then :class:`ReplyStats` with the
client's clock). Loading a local model takes the chat back.

What a server shows of itself is said plainly: the client's TTFT, TPOT and tokens/s; the
server's running and waiting requests as its ``/metrics`` reads when the reply is sent (under
vLLM's, SGLang's or llama.cpp's names); no layer timings and no KV map."""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QObject, QSettings, QTimer, Signal

from app.endpoints import keys
from app.endpoints.client import (
    Endpoint,
    EndpointError,
    Streamed,
    models,
    server_url,
    session,
    stream_chat,
)
from app.endpoints.server_metrics import scrape
from app.gui.commands import Cancel, Delta, ReplyStats, Send
from engine.core.metrics import RequestMetrics
from widgets.endpoint_page import EndpointCalls

if TYPE_CHECKING:
    from widgets.model_picker import ModelPicker

log = logging.getLogger(__name__)

#: the servers used, latest first, in the app's settings
RECENT_KEY = "endpoints/recent"
#: how long a Stop waits for a candidate to see it before ending it as stopped
GRACE_MS = 500
MAX_RECENT = 8
#: what the chat's sampling sends as OpenAI's fields; the rest only where set off neutral
#: (vLLM's and llama.cpp's extensions; a server that refuses one names it)
NEUTRAL = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
REMOTE_NOTE = (
    "Chatting with {name}. Its replies stream from the server; the status bar and the latency "
    "plot show what this client measures (TTFT, TPOT, tokens/s) and each reply's header the "
    "server's queue where its /metrics says it. Its layers and KV cache are not visible "
    "remotely: the instruments keep showing this process's engine. Load a local model to "
    "chat with it again."
)


def list_models(url: str, key: str | None) -> list[str]:
    """The endpoint page's call: the models the server lists (``key`` None: the kept one)."""
    return models(Endpoint(url, api_key=key or keys.key(url)))


def save_key(url: str, key: str) -> None:
    keys.save_key(url, key)


CALLS = EndpointCalls(list_models, save_key)


class RemoteChat(QObject):
    """The chat's replies from a server (see the module docstring)."""

    deltas = Signal(list)  # list[Delta], as the worker's
    reply_stats = Signal(object)  # ReplyStats, before the candidate's last delta
    changed = Signal(object)  # the Endpoint chatted with now, or None: the local model

    def __init__(self, settings: QSettings, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        self.endpoint: Endpoint | None = None
        self._replies: dict[str, _Reply] = {}  # by tag, until they have ended

    @property
    def active(self) -> bool:
        return self.endpoint is not None

    def recent(self) -> list[str]:
        value = self.settings.value(RECENT_KEY) or []
        return [str(u) for u in (value if isinstance(value, list) else [value])]

    def use(self, endpoint: Endpoint | None) -> None:
        """Chat with ``endpoint`` from the next reply on (None: the local model again); a
        server used is remembered first in the recent list."""
        if endpoint == self.endpoint:
            return
        self.endpoint = endpoint
        if endpoint is not None:
            url = server_url(endpoint.base_url)
            recent = [url, *(u for u in self.recent() if u != url)][:MAX_RECENT]
            self.settings.setValue(RECENT_KEY, recent)
            self.settings.setValue("endpoints/last_model", endpoint.model)
        self.changed.emit(endpoint)

    def attach(self, picker: ModelPicker) -> None:
        """The picker's endpoint page chooses the server."""
        page = picker.endpoint_page
        if page is None:
            return
        page.set_recent(self.recent())

        def requested(url: str, model: str, key: str) -> None:
            self.use(Endpoint(url, model, key or keys.key(url)))

        page.endpoint_requested.connect(requested)

    # -- the replies ------------------------------------------------------------------------
    def post(self, command: Send | Cancel) -> None:
        if isinstance(command, Cancel):
            self._cancel(command.tag)
            return
        endpoint = self.endpoint
        assert endpoint is not None, "post only while a server is chatted with"
        self._replies = {t: r for t, r in self._replies.items() if r.running()}
        reply = self._replies[command.tag] = _Reply(command.candidates)
        for candidate in range(command.candidates):
            thread = threading.Thread(
                target=self._reply, args=(endpoint, command, candidate, reply), daemon=True,
                name="infersight-remote-reply",
            )  # fmt: skip
            reply.threads.append(thread)
            thread.start()

    def _cancel(self, tag: str) -> None:
        """End a reply: each candidate at its next chunk (its connection closed: the server
        takes it as a cancel), the text so far kept; one still waiting for its first byte
        ends as stopped after :data:`GRACE_MS`, its thread left to close when a byte comes."""
        reply = self._replies.get(tag)
        if reply is None:
            return
        reply.cancel.set()
        QTimer.singleShot(GRACE_MS, self, lambda: self._give_up(tag, reply))

    def _give_up(self, tag: str, reply: _Reply) -> None:
        for candidate in range(reply.candidates):
            if reply.end(candidate):
                self.deltas.emit([Delta(tag, candidate, "", finish="cancelled")])

    def shutdown(self, timeout: float = 1.0) -> None:
        """Stop every reply and wait for them, ``timeout`` seconds in all (a thread still
        waiting for a server's first byte is a daemon: left to the process exit)."""
        for tag in list(self._replies):
            self._cancel(tag)
        deadline = time.monotonic() + timeout
        for reply in self._replies.values():
            for thread in reply.threads:
                thread.join(max(0.0, deadline - time.monotonic()))

    def _reply(self, endpoint: Endpoint, command: Send, candidate: int, state: _Reply) -> None:
        tag, cancel = command.tag, state.cancel
        reply = Streamed(time.perf_counter())
        finish, gauges = None, None
        try:
            body, extra = request_fields(command.sampling, candidate)
            with session(endpoint, 1) as client:
                if cancel.is_set():
                    raise EndpointError("dropped", "cancelled before it was sent")
                gauges = scrape(endpoint, client)  # the server's queue as the reply is sent
                stream = stream_chat(endpoint, command.messages, reply=reply, extra=extra,
                                     session=client, **body)  # fmt: skip
                for chunk in stream:
                    if cancel.is_set():
                        stream.close()
                        break
                    self.deltas.emit([Delta(tag, candidate, chunk.text)])
        except Exception as exc:  # a reply ends in one line, never a traceback
            if not cancel.is_set():  # (a cancel closes the connection: no failure, that)
                if not isinstance(exc, EndpointError):
                    log.exception("a reply from %s failed", endpoint.name)
                line = str(exc) if isinstance(exc, EndpointError) else f"{endpoint.name}: {exc!r}"
                if state.end(candidate):
                    self.deltas.emit([Delta(tag, candidate, "", finish="error", error=line)])
                return
        if cancel.is_set():
            finish = "cancelled"
        served = "served"
        if gauges is not None and math.isfinite(gauges.running) and math.isfinite(gauges.waiting):
            served += f" · at the server {gauges.running:g} running, {gauges.waiting:g} waiting"
        finish = finish or reply.finish_reason or "stop"
        rid = f"{tag}-{candidate}"
        metrics = metrics_of(reply, rid, finish)
        if state.end(candidate):  # (not ended for it by a Stop that gave up waiting)
            self.reply_stats.emit(ReplyStats(tag, candidate, rid, endpoint.name, served, metrics))
            self.deltas.emit([Delta(tag, candidate, "", finish=finish)])


@dataclass(slots=True)
class _Reply:
    """One reply's candidates: their cancel, their threads, and which have ended (each ends
    once: by its thread, or by a Stop that gave up waiting for it)."""

    candidates: int
    cancel: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    ended: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def running(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def end(self, candidate: int) -> bool:
        """Mark ``candidate`` ended; False where it already was."""
        with self.lock:
            if candidate in self.ended:
                return False
            self.ended.add(candidate)
            return True


def request_fields(
    sampling: dict[str, Any], candidate: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chat's sampling as :func:`stream_chat`'s arguments and the body's other fields:
    OpenAI's own always, the others only where set off neutral."""
    seed = sampling.get("seed")
    body = {
        "max_tokens": int(sampling.get("max_new_tokens") or 256),
        "temperature": float(sampling.get("temperature", 0.0)),
        "seed": None if seed is None else int(seed) + candidate,
    }
    extra: dict[str, Any] = {}
    if float(sampling.get("top_p", 1.0)) < 1.0:
        extra["top_p"] = float(sampling["top_p"])
    if sampling.get("stop"):
        extra["stop"] = list(sampling["stop"])
    for name, neutral in NEUTRAL.items():
        if sampling.get(name, neutral) != neutral:
            extra[name] = sampling[name]
    if sampling.get("constraint") is not None:  # the chat's Reply as JSON
        extra["response_format"] = {"type": "json_object"}
    return body, extra


def metrics_of(reply: Streamed, request_id: str, finish: str) -> RequestMetrics:
    """A streamed reply's figures by the client's clock (the queue is the server's: unknown)."""
    timed = [c.at for c in reply.chunks if c.text]
    ends = timed[-1] if timed else time.perf_counter()
    usage = reply.usage or {}
    prompt = usage.get("prompt_tokens")
    return RequestMetrics(
        request_id=request_id, finish_reason=finish,
        prompt_tokens=prompt if isinstance(prompt, int) else 0,
        output_tokens=reply.tokens, request_queue_time_seconds=None,
        time_to_first_token_seconds=reply.ttft_s, time_per_output_token_seconds=reply.tpot_s,
        e2e_request_latency_seconds=ends - reply.started,
        inter_token_latency_seconds=tuple(b - a for a, b in itertools.pairwise(timed)),
    )  # fmt: skip
