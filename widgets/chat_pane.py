"""The chat pane: conversation list, messages with streaming Markdown, the input box.

A thin view: it shows :class:`MessageView` data and emits what the user asked for; the app
decides what that means for the engine and the store.

With speculative decoding the reply streamed in this window can be shown marked ("Mark
speculation"): each piece of text coloured by how its tokens came, an accepted draft, the
model's correction of a rejected draft, or its bonus token after accepting every draft. The
marks are a view of the streamed pieces only: the message's text stays plain (what is copied
and stored), and a reply opened from the history has none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from PySide6.QtCore import QPoint, Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication, QKeyEvent
from PySide6.QtWidgets import (
    QCheckBox,
    QFrame,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QSplitter,
    QTabBar,
    QVBoxLayout,
    QWidget,
)

from widgets.markdown_view import SPECULATION_MARKS, MarkdownView

#: A message of the user's longer than this (lines, or characters) is shown folded to its
#: first lines, a button unfolding it (a pasted log or file)
FOLD_LINES, FOLD_CHARS = 12, 1500


def is_long(text: str) -> bool:
    return text.count("\n") >= FOLD_LINES or len(text) > FOLD_CHARS


#: While a reply streams its Markdown is rendered at most this often: each render parses the
#: whole reply again, so rendering every delta (up to 60 a second) grows quadratically.
STREAM_RENDER_MS = 50

STATUS_MARKS = {
    "streaming": "…",
    "stopped": "■ stopped",
    "error": "⚠ error",
    "interrupted": "⚠ interrupted",
    "cancelled": "■ stopped",
}


@dataclass(slots=True)
class MessageView:
    role: str  # user | assistant
    candidates: list[str] = field(default_factory=lambda: [""])
    status: str = "done"
    stats: str = ""
    selected: int = 0

    @property
    def text(self) -> str:
        return self.candidates[self.selected]


class MessageBubble(QFrame):
    """One message. An assistant message may hold several candidate replies, shown as tabs."""

    def __init__(self, view: MessageView, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.view = view
        #: per candidate, the streamed text as (piece, speculation kind): only for the mark
        #: overlay, and only where some piece came from a speculative step
        self.pieces: dict[int, list[tuple[str, str]]] = {}
        self.mark_speculation = False
        self.setObjectName("assistantBubble" if view.role == "assistant" else "userBubble")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(10, 6, 10, 8)
        head = QHBoxLayout()
        self.role_label = QLabel("You" if view.role == "user" else "Assistant")
        self.role_label.setObjectName("roleLabel")
        self.status_label = QLabel()
        self.status_label.setObjectName("statusLabel")
        # a long stats line must not widen the message column: it wraps (and is whole in the
        # tip), so the cached tokens and why the reply ended are never cut off
        self.status_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.status_label.setWordWrap(True)
        self.copy_button = QPushButton("Copy")
        self.copy_button.setObjectName("copyButton")
        self.copy_button.setToolTip("Copy this message as Markdown")
        self.copy_button.clicked.connect(self._copy)
        head.addWidget(self.role_label)
        head.addWidget(self.status_label, 1)
        head.addWidget(self.copy_button)
        layout.addLayout(head)
        self.tabs = QTabBar()
        self.tabs.currentChanged.connect(self._select)
        layout.addWidget(self.tabs)
        #: the prompt being read before the first token (a long conversation, a reload):
        #: tokens done of all, shown only then
        self.prefill_bar = QProgressBar()
        self.prefill_bar.setObjectName("prefillBar")
        self.prefill_bar.setFormat("reading the prompt: %v / %m tokens")
        self.prefill_bar.hide()
        layout.addWidget(self.prefill_bar)
        self.body = MarkdownView()
        layout.addWidget(self.body)
        #: a long paste of the user's is shown folded: its first lines and this to unfold
        self.folded = view.role == "user"
        self.fold_button = QPushButton()
        self.fold_button.setObjectName("foldButton")
        self.fold_button.setFlat(True)
        self.fold_button.clicked.connect(self._toggle_fold)
        self.fold_button.hide()
        layout.addWidget(self.fold_button, 0, Qt.AlignmentFlag.AlignLeft)
        self._render_timer = QTimer(self, singleShot=True, interval=STREAM_RENDER_MS)
        self._render_timer.timeout.connect(self.refresh)
        self.refresh()

    def refresh(self) -> None:
        self._render_timer.stop()  # whatever was pending is rendered now
        v = self.view
        blocked = self.tabs.blockSignals(True)  # a first tab added is no choice of the user's
        while self.tabs.count() < len(v.candidates):
            self.tabs.addTab(f"Reply {self.tabs.count() + 1}")
        self.tabs.blockSignals(blocked)
        self.tabs.setVisible(len(v.candidates) > 1)
        if self.tabs.currentIndex() != v.selected:
            self.tabs.setCurrentIndex(v.selected)
        text = v.text
        if v.status == "streaming" and not text:
            text = "…"
        long = v.role == "user" and is_long(text)
        if long and self.folded:
            shown = text.splitlines()[:FOLD_LINES]
            text = "\n".join(shown)[:FOLD_CHARS] + "\n\n…"
        self.fold_button.setVisible(long)
        if long:
            lines = len(v.text.splitlines())
            self.fold_button.setText(
                f"Show all {lines:,} lines ({len(v.text):,} characters)" if self.folded
                else "Fold"
            )  # fmt: skip
        pieces = self.pieces.get(v.selected)
        if self.mark_speculation and pieces and "".join(t for t, _ in pieces) == v.text:
            self.body.set_marked(pieces)
        else:
            self.body.set_text(text)
        mark = STATUS_MARKS.get(v.status, "")
        status = "  ".join(p for p in (mark, v.stats) if p)
        self.status_label.setText(status)
        self.status_label.setToolTip(status)

    def _toggle_fold(self) -> None:
        self.folded = not self.folded
        self.refresh()

    def show_prefill(self, done: int, total: int) -> None:
        """``done`` of the prompt's ``total`` tokens read (cached ones count as read)."""
        if self.view.text:  # the reply has begun: the prompt is read
            return
        self.prefill_bar.setRange(0, max(1, total))
        self.prefill_bar.setValue(min(done, total))
        self.prefill_bar.show()

    def append(self, candidate: int, text: str, pieces: tuple[tuple[str, str], ...] = ()) -> None:
        """Streamed text: kept at once, rendered within :data:`STREAM_RENDER_MS`. ``pieces``
        splits ``text`` by speculation kind (``Delta.pieces``), for the mark overlay."""
        self.prefill_bar.hide()
        before = self.view.candidates[candidate]
        self.view.candidates[candidate] += text
        if pieces or candidate in self.pieces:
            kept = self.pieces.setdefault(candidate, [(before, "")] if before else [])
            for piece, kind in pieces or ((text, ""),):
                if not piece:
                    continue
                if kept and kept[-1][1] == kind:
                    kept[-1] = (kept[-1][0] + piece, kind)
                else:
                    kept.append((piece, kind))
        if candidate == self.view.selected and not self._render_timer.isActive():
            self._render_timer.start()

    def set_mark_speculation(self, on: bool) -> None:
        """Show the streamed pieces coloured by how they came, or the plain Markdown."""
        if on != self.mark_speculation:
            self.mark_speculation = on
            if self.pieces:
                self.refresh()

    def _select(self, index: int) -> None:
        if 0 <= index < len(self.view.candidates) and index != self.view.selected:
            self.view.selected = index
            self.refresh()

    def _copy(self) -> None:
        QGuiApplication.clipboard().setText(self.view.text)


class _Input(QPlainTextEdit):
    """Enter sends, Shift+Enter is a new line."""

    submitted = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
            event.modifiers() & Qt.KeyboardModifier.ShiftModifier
        ):
            self.submitted.emit()
            return
        super().keyPressEvent(event)


class ChatPane(QWidget):
    send_requested = Signal(str)
    stop_requested = Signal()
    regenerate_requested = Signal()
    edit_requested = Signal()
    new_conversation_requested = Signal()
    conversation_selected = Signal(int)
    rename_requested = Signal(int, str)
    delete_requested = Signal(int)
    system_prompt_edited = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.bubbles: list[MessageBubble] = []
        self._generating = False
        self._follow = True

        # conversations
        self.conversation_list = QListWidget()
        self.conversation_list.setObjectName("conversationList")
        self.conversation_list.currentItemChanged.connect(self._on_conversation)
        self.conversation_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.conversation_list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.conversation_list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.conversation_list.customContextMenuRequested.connect(self._conversation_menu)
        self.conversation_list.setToolTip("Rename or delete a conversation with the buttons "
                                          "below, or by right-clicking it")  # fmt: skip
        self.new_button = QPushButton("New chat")
        self.new_button.clicked.connect(self.new_conversation_requested)
        side = QWidget()
        side_layout = QVBoxLayout(side)
        side_layout.setContentsMargins(0, 0, 0, 0)
        side_layout.addWidget(self.new_button)
        side_layout.addWidget(self.conversation_list)
        # the selected conversation's rename and delete, in view (also on right-click and keys)
        row = QHBoxLayout()
        self.rename_button = QPushButton("Rename…")
        self.rename_button.setToolTip("Rename the selected conversation (F2)")
        self.rename_button.setShortcut("F2")
        self.rename_button.clicked.connect(
            lambda: self._rename(self.conversation_list.currentItem())
        )
        self.delete_button = QPushButton("Delete")
        self.delete_button.setToolTip("Delete the selected conversation")
        self.delete_button.clicked.connect(
            lambda: self._delete(self.conversation_list.currentItem())
        )
        row.addWidget(self.rename_button)
        row.addWidget(self.delete_button)
        side_layout.addLayout(row)

        # messages
        self.system_prompt = QLineEdit()
        self.system_prompt.setPlaceholderText("System prompt for this conversation (optional)")
        self.system_prompt.setToolTip(
            "Sent before every turn of this conversation; it costs prompt tokens (prefill time "
            "and KV cache) on each reply"
        )
        self.system_prompt.editingFinished.connect(
            lambda: self.system_prompt_edited.emit(self.system_prompt.text())
        )
        self.notice = QLabel()
        self.notice.setObjectName("notice")
        self.notice.setWordWrap(True)
        self.notice.setVisible(False)
        self.notice.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self._notice_timer = QTimer(self, singleShot=True, interval=15000)
        self._notice_timer.timeout.connect(self._hide_notice)
        # what the notice offers to do about it (one button, shown with the notice)
        self.notice_action = QPushButton()
        self.notice_action.setVisible(False)
        self.notice_action.clicked.connect(self._notice_clicked)
        self._notice_do: Callable[[], None] | None = None
        self.messages_widget = QWidget()
        self.messages_layout = QVBoxLayout(self.messages_widget)
        self.messages_layout.setAlignment(Qt.AlignmentFlag.AlignTop)
        self.messages_layout.setSpacing(8)
        self.scroll_area = QScrollArea()
        self.scroll_area.setWidgetResizable(True)
        self.scroll_area.setWidget(self.messages_widget)
        self.scroll_area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        bar = self.scroll_area.verticalScrollBar()
        bar.rangeChanged.connect(self._on_range)
        bar.valueChanged.connect(self._on_scroll)

        self.input = _Input()
        self.input.setPlaceholderText("Message (Enter sends, Shift+Enter for a new line)")
        self.input.setFixedHeight(72)
        self.input.submitted.connect(self._submit)
        self.send_button = QPushButton("Send")
        self.send_button.setDefault(True)
        self.send_button.clicked.connect(self._submit)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setToolTip("Stop the reply; the text so far is kept")
        self.stop_button.clicked.connect(self.stop_requested)
        self.regenerate_button = QPushButton("Regenerate")
        self.regenerate_button.setToolTip("Replace the last reply with a new one")
        self.regenerate_button.clicked.connect(self.regenerate_requested)
        self.edit_button = QPushButton("Edit last")
        self.edit_button.setToolTip("Take the last message back into the input box to resend it")
        self.edit_button.clicked.connect(self.edit_requested)
        self.mark_speculation = QCheckBox("Mark speculation")
        self.mark_speculation.setToolTip(
            "Colour the reply streamed with speculative decoding by how each piece came: a "
            "draft the model accepted, the model's own token where it rejected a draft, or its "
            "bonus token after accepting them all. A view only: the text stays the same"
        )
        self.mark_speculation.toggled.connect(self._on_mark_speculation)
        self.json_reply = QCheckBox("Reply as JSON")
        self.json_reply.setToolTip(
            "Hold the next replies to a JSON object: a grammar masks every token that could "
            "not continue valid JSON (structured output)"
        )
        self.speculation_legend = QWidget()
        legend = QHBoxLayout(self.speculation_legend)
        legend.setContentsMargins(0, 0, 0, 0)
        for colour, label in SPECULATION_MARKS.values():
            swatch = QLabel(label)
            swatch.setStyleSheet(
                f"background: {colour}; border-radius: 3px; padding: 0 4px; font-size: 9pt"
            )
            legend.addWidget(swatch)
        self.speculation_legend.setVisible(False)
        buttons = QHBoxLayout()
        for b in (self.regenerate_button, self.edit_button):
            buttons.addWidget(b)
        buttons.addWidget(self.mark_speculation)
        buttons.addWidget(self.json_reply)
        buttons.addWidget(self.speculation_legend)
        buttons.addStretch(1)
        buttons.addWidget(self.stop_button)
        buttons.addWidget(self.send_button)

        main = QWidget()
        main_layout = QVBoxLayout(main)
        main_layout.setContentsMargins(0, 0, 0, 0)
        main_layout.addWidget(self.system_prompt)
        notice_row = QHBoxLayout()
        notice_row.addWidget(self.notice, 1)
        notice_row.addWidget(self.notice_action)
        main_layout.addLayout(notice_row)
        main_layout.addWidget(self.scroll_area, 1)
        main_layout.addWidget(self.input)
        main_layout.addLayout(buttons)

        splitter = QSplitter()
        splitter.addWidget(side)
        splitter.addWidget(main)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([170, 600])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(splitter)
        self.set_generating(False)

    # -- conversations -----------------------------------------------------------------------
    def set_conversations(self, items: list[tuple[int, str]], current: int | None) -> None:
        self.conversation_list.blockSignals(True)
        self.conversation_list.clear()
        for conversation_id, title in items:
            item = QListWidgetItem(title)
            item.setData(Qt.ItemDataRole.UserRole, conversation_id)
            item.setToolTip(title)
            self.conversation_list.addItem(item)
            if conversation_id == current:
                self.conversation_list.setCurrentItem(item)
        self.conversation_list.blockSignals(False)

    def _conversation_menu(self, pos: QPoint) -> None:
        item = self.conversation_list.itemAt(pos)
        if item is None:
            return
        conversation_id = int(item.data(Qt.ItemDataRole.UserRole))
        menu = QMenu(self)
        rename = menu.addAction("Rename…")
        delete = menu.addAction("Delete")
        chosen = menu.exec(self.conversation_list.mapToGlobal(pos))
        if chosen is rename:
            self._rename(item)
        elif chosen is delete:
            self.delete_requested.emit(conversation_id)

    def _rename(self, item: QListWidgetItem | None) -> None:
        if item is None:
            return
        title, ok = QInputDialog.getText(self, "Rename", "Title:", text=item.text())
        if ok and title.strip():
            self.rename_requested.emit(int(item.data(Qt.ItemDataRole.UserRole)), title.strip())

    def _delete(self, item: QListWidgetItem | None) -> None:
        if item is not None:
            self.delete_requested.emit(int(item.data(Qt.ItemDataRole.UserRole)))

    def _on_conversation(self, item: QListWidgetItem | None, _: object = None) -> None:
        if item is not None:
            self.conversation_selected.emit(int(item.data(Qt.ItemDataRole.UserRole)))

    # -- messages ----------------------------------------------------------------------------
    def show_messages(self, views: list[MessageView], system_prompt: str = "") -> None:
        for bubble in self.bubbles:
            bubble.deleteLater()
        self.bubbles = []
        for view in views:
            self.add_message(view)
        self.system_prompt.setText(system_prompt)
        self._follow = True
        self._update_buttons()

    def add_message(self, view: MessageView) -> MessageBubble:
        bubble = MessageBubble(view)
        bubble.mark_speculation = self.mark_speculation.isChecked()
        self.messages_layout.addWidget(bubble)
        self.bubbles.append(bubble)
        self._update_buttons()
        return bubble

    def remove_last(self, count: int = 1) -> None:
        for _ in range(min(count, len(self.bubbles))):
            self.bubbles.pop().deleteLater()
        self._update_buttons()

    @property
    def last(self) -> MessageBubble | None:
        return self.bubbles[-1] if self.bubbles else None

    def append_to_last(
        self, candidate: int, text: str, pieces: tuple[tuple[str, str], ...] = ()
    ) -> None:
        """Streamed text for the last message; ``pieces`` (text, speculation kind) split it
        for the mark overlay."""
        if self.last is not None:
            self.last.append(candidate, text, pieces)

    def _on_mark_speculation(self, on: bool) -> None:
        self.speculation_legend.setVisible(on)
        for bubble in self.bubbles:
            bubble.set_mark_speculation(on)

    def show_prefill(self, done: int, total: int) -> None:
        """The last reply's prompt being read: ``done`` of ``total`` tokens."""
        if self.last is not None:
            self.last.show_prefill(done, total)

    def finish_last(self, status: str, stats: str = "") -> None:
        if self.last is not None:
            self.last.prefill_bar.hide()
            self.last.view.status = status
            self.last.view.stats = stats
            self.last.refresh()

    # -- input -------------------------------------------------------------------------------
    def _submit(self) -> None:
        text = self.input.toPlainText().strip()
        if text and not self._generating:
            self.send_requested.emit(text)

    def clear_input(self) -> None:
        self.input.clear()

    def set_input(self, text: str) -> None:
        self.input.setPlainText(text)
        self.input.setFocus()

    def set_generating(self, generating: bool) -> None:
        self._generating = generating
        self.send_button.setEnabled(not generating)
        self.stop_button.setEnabled(generating)
        self._update_buttons()

    def _update_buttons(self) -> None:
        idle = not self._generating
        self.regenerate_button.setEnabled(idle and bool(self.bubbles))
        self.edit_button.setEnabled(idle and any(b.view.role == "user" for b in self.bubbles))

    @property
    def generating(self) -> bool:
        return self._generating

    def show_notice(
        self, text: str, level: str = "error",
        action: tuple[str, Callable[[], None]] | None = None,
    ) -> None:  # fmt: skip
        """An in-window message above the conversation (no modal dialog); ``action``: a
        button beside it, its label and what it does (it stays until used or replaced)."""
        self.notice.setProperty("level", level)
        self.notice.style().unpolish(self.notice)
        self.notice.style().polish(self.notice)
        self.notice.setText(text)
        self.notice.setVisible(True)
        self._notice_do = None if action is None else action[1]
        self.notice_action.setText("" if action is None else action[0])
        self.notice_action.setVisible(action is not None)
        if action is None:
            self._notice_timer.start()
        else:
            self._notice_timer.stop()

    def _hide_notice(self) -> None:
        self.notice.setVisible(False)
        self.notice_action.setVisible(False)
        self._notice_do = None

    def _notice_clicked(self) -> None:
        do = self._notice_do
        self._hide_notice()
        if do is not None:
            do()

    # -- following the end -----------------------------------------------------------------
    def _on_range(self, _min: int, maximum: int) -> None:
        if self._follow:
            self.scroll_area.verticalScrollBar().setValue(maximum)

    def _on_scroll(self, value: int) -> None:
        self._follow = value >= self.scroll_area.verticalScrollBar().maximum() - 8

    @property
    def following(self) -> bool:
        return self._follow
