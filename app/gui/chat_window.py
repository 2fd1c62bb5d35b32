"""The chat's half of the main window (:class:`ChatWindow`): the conversations in the store
and the reply that streams into the last bubble, saved as it grows."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from PySide6.QtCore import QSettings, QTimer
from PySide6.QtWidgets import QLabel, QMainWindow

from app.conversations import ChatStore, Message
from app.gui.commands import Cancel, Delta, ModelInfo, ReplyStats, Send
from app.gui.status import settings_label
from app.loading import LoadSpec
from engine.core.metrics import RequestMetrics
from engine.core.structured import Constraint
from widgets.chat_pane import ChatPane, MessageView
from widgets.controls import ControlsPanel
from widgets.instruments import InstrumentsPanel, RequestPoint

if TYPE_CHECKING:
    from app.gui.remote_chat import RemoteChat
    from app.gui.worker import EngineWorker


#: a streaming reply's text reaches the store within this many seconds, and no more often
SAVE_INTERVAL_S = 1.0


@dataclass(slots=True)
class ActiveReply:
    """The reply being streamed into the last bubble."""

    tag: str
    message_id: int
    conversation_id: int
    candidates: list[str]  # the earlier versions kept by Regenerate, then this reply's
    open: set[int]
    status: str = "done"
    first: int = 0  # this reply's first candidate in ``candidates``
    settings: str = ""  # what it was made with (sampling, window, processes): its header's
    stats: dict[int, ReplyStats] = field(default_factory=dict)
    error: str | None = None
    saved_at: float = field(default_factory=time.monotonic)  # last write of its text
    unsaved: bool = False  # text streamed since then
    save_scheduled: bool = False


#: Why a reply ended, in the words its header uses.
STOP_WORDS = {
    "stop": "ended by the model",
    "length": "cut at the token limit",
    "cancelled": "stopped",
    "timeout": "timed out",
    "error": "failed",
}


def stats_text(stats: ReplyStats) -> str:
    m = stats.metrics
    parts = [f"{stats.model} · {stats.precision}"]
    if m.finish_reason:
        parts.append(STOP_WORDS.get(m.finish_reason, m.finish_reason))
    if stats.tokens_per_s is not None:
        parts.append(f"{stats.tokens_per_s:.1f} tok/s")
    if m.time_to_first_token_seconds is not None:
        parts.append(ttft_text(m))
    parts.append(f"{m.output_tokens} tokens")
    return " · ".join(parts)


def ttft_text(m: RequestMetrics) -> str:
    """TTFT and what it was spent on: the queue, then the prefill, which computed some of the
    prompt and found the rest in the prefix cache."""
    text = f"TTFT {(m.time_to_first_token_seconds or 0.0) * 1e3:.0f} ms"
    if m.request_queue_time_seconds is None or m.prefill_time_seconds is None:
        return text
    return (
        f"{text} (queue {m.request_queue_time_seconds * 1e3:.0f} ms, prefill "
        f"{m.prefill_time_seconds * 1e3:.0f} ms: {m.computed_prompt_tokens} prompt tokens "
        f"computed, {m.cached_prompt_tokens} cached)"
    )


class ChatWindow(QMainWindow):
    """Conversations and replies: :class:`~app.gui.main_window.MainWindow` makes the widgets,
    the store and the worker these methods use, and wires the chat pane's signals to them."""

    # made by MainWindow.__init__
    store: ChatStore
    settings: QSettings
    chat: ChatPane
    controls: ControlsPanel
    instruments: InstrumentsPanel
    worker: EngineWorker
    remote: RemoteChat  # the server the chat talks to instead, where one is chosen
    status_speed: QLabel
    status_ttft: QLabel
    status_context: QLabel
    model: ModelInfo | None  # the model loaded now, and the one loading
    loading: LoadSpec | None
    active: ActiveReply | None  # the reply streaming now
    conversation_id: int | None
    last_stats: ReplyStats | None
    _tags: int  # replies started, for their tags
    #: what a failed reply's notice offers to do (label, action): set while the engine
    #: cannot go on as it is (a tensor-parallel rank failed), None otherwise
    recovery: tuple[str, Callable[[], None]] | None

    # -- conversations -------------------------------------------------------------------------
    def _open_conversations(self) -> None:
        conversations = self.store.conversations()
        if not conversations:
            self.store.create_conversation()
            conversations = self.store.conversations()
        saved = self.settings.value("conversation")
        ids = [c.id for c in conversations]
        current = int(saved) if saved is not None and int(str(saved)) in ids else ids[0]
        self.select_conversation(current)

    def _refresh_list(self) -> None:
        items = [(c.id, c.title) for c in self.store.conversations()]
        self.chat.set_conversations(items, self.conversation_id)

    def select_conversation(self, conversation_id: int) -> None:
        if self.active is not None:
            self.chat.show_notice("A reply is still streaming; stop it first", "warning")
            self._refresh_list()
            return
        self.conversation_id = conversation_id
        self.settings.setValue("conversation", conversation_id)
        conv = self.store.conversation(conversation_id)
        self.chat.show_messages(
            [self._view(m) for m in self.store.messages(conversation_id)], conv.system_prompt
        )
        self._refresh_list()

    def new_conversation(self) -> None:
        if self.active is not None:
            self.chat.show_notice("A reply is still streaming; stop it first", "warning")
            return
        untouched = self.store.untouched_conversation()  # one empty chat is enough
        self.select_conversation(
            untouched if untouched is not None else self.store.create_conversation()
        )

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        self.store.rename(conversation_id, title)
        self._refresh_list()

    def delete_conversation(self, conversation_id: int) -> None:
        if self.active is not None and self.active.conversation_id == conversation_id:
            self.chat.show_notice(
                "A reply is streaming in that conversation; stop it first", "warning"
            )
            return
        self.store.delete_conversation(conversation_id)
        if conversation_id != self.conversation_id:
            self._refresh_list()
            return
        remaining = self.store.conversations()
        self.select_conversation(remaining[0].id if remaining else self.store.create_conversation())

    def _on_system_prompt(self, text: str) -> None:
        if self.conversation_id is not None:
            self.store.set_system_prompt(self.conversation_id, text)

    @staticmethod
    def _view(m: Message) -> MessageView:
        candidates = m.meta.get("candidates") or [m.content]
        selected = int(m.meta.get("selected", 0))
        return MessageView(m.role, list(candidates), m.status, m.meta.get("stats", ""), selected)

    def _engine_messages(self) -> list[dict[str, str]]:
        assert self.conversation_id is not None
        conv = self.store.conversation(self.conversation_id)
        out = [{"role": "system", "content": conv.system_prompt}] if conv.system_prompt else []
        for m in self.store.messages(self.conversation_id):
            if m.role == "user" or (m.content and m.status != "streaming"):
                out.append({"role": m.role, "content": m.content})
        return out

    # -- chatting ----------------------------------------------------------------------------
    def send(self, text: str) -> None:
        if self.active is not None:
            return
        if self.model is None and not self.remote.active:
            what = "The model is still loading" if self.loading else "No model is loaded"
            self.chat.show_notice(
                f"{what}; your message is kept in the box, send it again once the status bar "
                "shows the model",
                "warning",
            )
            return
        assert self.conversation_id is not None
        if not self.store.messages(self.conversation_id):
            self.store.rename(self.conversation_id, text.splitlines()[0][:60])
        self.store.add_message(self.conversation_id, "user", text)
        self.chat.add_message(MessageView("user", [text]))
        self.chat.clear_input()
        self._start_reply()

    def _start_reply(self, earlier: list[str] | None = None) -> None:
        """A reply to the conversation; ``earlier``: the versions Regenerate keeps before it,
        shown as its first tabs."""
        assert self.conversation_id is not None
        kept = list(earlier or [])
        n = self.controls.num_candidates()
        try:
            sampling = self.controls.sampling()
        except ValueError as exc:
            self.chat.show_notice(str(exc), "warning")
            return
        if self.chat.json_reply.isChecked():
            sampling["constraint"] = Constraint("json_object")
        messages = self._engine_messages()
        message_id = self.store.add_message(self.conversation_id, "assistant", "", "streaming")
        self._tags += 1
        tag = f"reply-{self._tags}"
        first = len(kept)
        candidates = [*kept, *[""] * n]
        settings = settings_label(sampling, self.controls.cache_window(),
                                  self.controls.prefix_cache())  # fmt: skip
        if self.model is not None and self.model.tensor_parallel > 1:
            settings += f" · {self.model.tensor_parallel} processes"
        self.active = ActiveReply(
            tag, message_id, self.conversation_id, candidates, set(range(first, first + n)),
            first=first, settings=settings,
        )  # fmt: skip
        self.chat.add_message(MessageView("assistant", list(candidates), "streaming", "", first))
        self.chat.set_generating(True)
        self._refresh_list()
        # to the server the chat talks to, or to the engine in this process
        (self.remote if self.remote.active else self.worker).post(Send(tag, messages, sampling, n))

    def stop(self) -> None:
        if self.active is not None:
            self.worker.post(Cancel(self.active.tag))  # whichever runs it: the other has none
            self.remote.post(Cancel(self.active.tag))

    def regenerate(self) -> None:
        if self.active is not None or self.conversation_id is None:
            return
        messages = self.store.messages(self.conversation_id)
        if not messages:
            return
        if self.model is None and not self.remote.active:
            self.chat.show_notice("No model is loaded yet; wait for it, then regenerate", "warning")
            return
        earlier: list[str] = []
        last = messages[-1]
        if last.role == "assistant":  # kept as versions: the new reply is one more
            earlier = [t for t in (last.meta.get("candidates") or [last.content]) if t]
            self.store.delete_messages_from(last.id)
            self.chat.remove_last()
        self._start_reply(earlier)

    def edit_last(self) -> None:
        if self.active is not None or self.conversation_id is None:
            return
        messages = self.store.messages(self.conversation_id)
        users = [i for i, m in enumerate(messages) if m.role == "user"]
        if not users:
            return
        index = users[-1]
        self.store.delete_messages_from(messages[index].id)
        self.chat.remove_last(len(messages) - index)
        self.chat.set_input(messages[index].content)

    def _on_prefill(self, tag: str, done: int, total: int) -> None:
        if self.active is not None and self.active.tag == tag:
            self.chat.show_prefill(done, total)

    def _on_deltas(self, deltas: list[Delta]) -> None:
        reply = self.active
        if reply is None:
            return
        for d in deltas:
            if d.tag != reply.tag:
                continue
            at = reply.first + d.candidate  # after the versions kept
            if d.text:
                reply.candidates[at] += d.text
                reply.unsaved = True
                self.chat.append_to_last(at, d.text, d.pieces)
            if d.finish is not None:
                reply.open.discard(at)
                if d.finish == "error":
                    reply.status, reply.error = "error", d.error
                elif d.finish == "cancelled" and reply.status == "done":
                    reply.status = "stopped"
        if not reply.open:
            self._finish_reply(reply)
        elif reply.unsaved:
            self._save_soon(reply)

    def _save_soon(self, reply: ActiveReply) -> None:
        """Write the streamed text now if the last write is ``SAVE_INTERVAL_S`` old, else when
        it will be: a kill loses at most a second of a reply, at one UPDATE a second."""
        wait = reply.saved_at + SAVE_INTERVAL_S - time.monotonic()
        if wait <= 0:
            self._save_streamed(reply)
        elif not reply.save_scheduled:
            reply.save_scheduled = True
            QTimer.singleShot(int(wait * 1000) + 1, self, lambda: self._save_streamed(reply))

    def _save_streamed(self, reply: ActiveReply) -> None:
        reply.save_scheduled = False
        if self.active is not reply or not reply.unsaved:
            return  # finished (and saved) meanwhile, or nothing new
        selected, meta = self._reply_record(reply)
        self.store.update_message(reply.message_id, content=reply.candidates[selected], meta=meta)
        reply.saved_at, reply.unsaved = time.monotonic(), False

    def _reply_record(self, reply: ActiveReply) -> tuple[int, dict[str, object]]:
        """The candidate shown (its text is the message's content) and the meta to store."""
        bubble = self.chat.last
        selected = bubble.view.selected if bubble is not None else 0
        meta: dict[str, object] = {"selected": selected}
        if len(reply.candidates) > 1:
            meta["candidates"] = list(reply.candidates)
        return selected, meta

    def _finish_reply(self, reply: ActiveReply) -> None:
        self.active = None
        selected, meta = self._reply_record(reply)
        stats = reply.stats.get(selected) or next(iter(reply.stats.values()), None)
        text = " · ".join(t for t in (stats_text(stats) if stats else "", reply.settings) if t)
        meta["stats"] = text
        if stats is not None:
            meta["model"], meta["precision"] = stats.model, stats.precision
        self.store.update_message(
            reply.message_id, content=reply.candidates[selected], status=reply.status, meta=meta
        )
        self.chat.finish_last(reply.status, text)
        self.chat.set_generating(False)
        if reply.error:
            self.chat.show_notice(
                f"The reply ended with an error: {reply.error}. The chat is kept; you can send "
                "again or regenerate.",
                action=self.recovery,
            )

    def _on_stats(self, stats: ReplyStats) -> None:
        if self.active is not None and stats.tag == self.active.tag:
            self.active.stats[self.active.first + stats.candidate] = stats
        if stats.candidate == 0:
            self.last_stats = stats
            m = stats.metrics
            tps = stats.tokens_per_s
            self.status_speed.setText("– tok/s" if tps is None else f"{tps:.1f} tok/s")
            ttft = m.time_to_first_token_seconds
            self.status_ttft.setText("TTFT –" if ttft is None else f"TTFT {ttft * 1e3:.0f} ms")
            self.status_ttft.setToolTip(f"The last reply's {ttft_text(m)}")
            if self.model is not None and not self.remote.active:
                used = m.prompt_tokens + m.output_tokens
                self.status_context.setText(f"context {used} / {self.model.context_length}")
        self.instruments.add_request(
            RequestPoint(
                stats.metrics.time_to_first_token_seconds or 0.0,
                stats.metrics.time_per_output_token_seconds,
            )
        )
