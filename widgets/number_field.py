"""A number typed into a line edit (:class:`NumberField`): a value out of range is refused
with a message (the ``invalid`` signal) and the field goes back to its last good value, so a
form of them always holds settings the engine accepts; :func:`add_field` puts one in a form."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PySide6.QtCore import Signal, SignalInstance
from PySide6.QtWidgets import QFormLayout, QLineEdit


class NumberField(QLineEdit):
    """A number with bounds; refuses what is out of range and says why."""

    changed = Signal()  # the user entered a new value
    shown = Signal()  # the value shown changed: by the user or by set_value
    invalid = Signal(str)

    def __init__(
        self,
        name: str,
        value: float | None,
        *,
        lo: float,
        hi: float,
        integer: bool = False,
        lo_open: bool = False,
        optional: bool = False,
        tip: str = "",
    ) -> None:
        super().__init__()
        self.name, self.lo, self.hi = name, lo, hi
        self.integer, self.lo_open, self.optional = integer, lo_open, optional
        self._good = self._format(value)
        self.setText(self._good)
        self.setToolTip(tip)
        if optional:
            self.setPlaceholderText("off")
        self.editingFinished.connect(self._check)
        self.changed.connect(self.shown)

    def _format(self, value: float | None) -> str:
        if value is None:
            return ""
        return str(int(value)) if self.integer else f"{value:g}"

    def _range_text(self) -> str:
        left = "(" if self.lo_open else "["
        return f"{left}{self._format(self.lo)}, {self._format(self.hi)}]"

    def parse(self, text: str) -> float | None:
        """The value of ``text``; raises ValueError with a message for the user."""
        text = text.strip()
        if not text:
            if self.optional:
                return None
            raise ValueError(f"{self.name} needs a value in {self._range_text()}")
        try:
            value = int(text) if self.integer else float(text)
        except ValueError:
            kind = "a whole number" if self.integer else "a number"
            raise ValueError(f"{self.name} must be {kind}, not {text!r}") from None
        too_low = value <= self.lo if self.lo_open else value < self.lo
        if too_low or value > self.hi or value != value:
            raise ValueError(f"{self.name} must be in {self._range_text()}; {text} is out of range")
        return value

    def value(self) -> float | None:
        return self.parse(self._good)

    def set_value(self, value: float | None) -> None:
        self.parse(self._format(value))  # refuses a bad stored value
        self._good = self._format(value)
        self.setText(self._good)
        self.shown.emit()

    def holds(self, value: float | None) -> bool:
        """Whether the field shows ``value`` (as it would display it)."""
        return self._good == self._format(value)

    def _check(self) -> None:
        if self.text() == self._good:
            return
        try:
            value = self.parse(self.text())
        except ValueError as exc:
            self.setText(self._good)
            self.invalid.emit(f"{exc}; kept {self._good or 'off'}")
            return
        self._good = self._format(value)
        self.setText(self._good)
        self.changed.emit()


def add_field(
    form: QFormLayout,
    label: str,
    name: str,
    value: float | None,
    *,
    invalid: SignalInstance,
    on_change: Callable[[], object] | SignalInstance,
    **kwargs: Any,
) -> NumberField:
    """A :class:`NumberField` as a row of ``form``: what it refuses goes to ``invalid``, and
    ``on_change`` hears of each new value the user enters."""
    field = NumberField(name, value, **kwargs)
    field.invalid.connect(invalid)
    field.changed.connect(on_change)
    form.addRow(label, field)
    return field
