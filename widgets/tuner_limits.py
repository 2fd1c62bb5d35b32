"""The tuner's scheduler limits: one slider per limit (max batch size, max tokens per step, max
wait, the KV pool's usable blocks), applied as the user moves them and kept in step with the
limits the engine reports."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QGridLayout, QGroupBox, QHBoxLayout, QLabel, QSlider, QWidget


class LimitSlider(QWidget):
    """A horizontal slider over one scheduler limit, with its value shown beside it.

    Positions are ``value / step``; :meth:`set_value` moves it without emitting ``moved``
    (the engine's own value is shown as it is, even off the slider's grid or range)."""

    moved = Signal(str, float)  # key, value: the user moved it

    def __init__(
        self,
        key: str,
        lo: int,
        hi: int,
        *,
        step: int = 1,
        describe: Callable[[float], str] | None = None,
        tip: str = "",
    ) -> None:
        super().__init__()
        self.key, self.step = key, step
        self._describe = describe or (lambda v: f"{v:g}")
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setToolTip(tip)
        self.label = QLabel()
        self.label.setMinimumWidth(150)
        self.set_range(lo, hi)
        self.slider.valueChanged.connect(self._moved)
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.slider, 1)
        row.addWidget(self.label)

    def set_range(self, lo: int, hi: int) -> None:
        self.slider.blockSignals(True)
        try:
            self.slider.setRange(lo // self.step, max(lo, hi) // self.step)
        finally:
            self.slider.blockSignals(False)

    def value(self) -> float:
        return float(self.slider.value() * self.step)

    def set_value(self, value: float) -> None:
        self.slider.blockSignals(True)
        try:
            self.slider.setValue(round(value / self.step))
        finally:
            self.slider.blockSignals(False)
        self.label.setText(self._describe(value))

    def refresh(self) -> None:
        """Describe the current position again (the description depends on other state)."""
        self.label.setText(self._describe(self.value()))

    def _moved(self, position: int) -> None:
        value = float(position * self.step)
        self.label.setText(self._describe(value))
        self.moved.emit(self.key, value)


class LimitsGroup(QGroupBox):
    """The four limits' sliders, two by two; ``changed`` carries the key a slider changed and
    its value (whole numbers but the wait)."""

    changed = Signal(dict)

    def __init__(self) -> None:
        super().__init__("Scheduler limits (applied as you move them)")
        self._block_size = 16
        grid_layout = QGridLayout(self)
        self.sliders: dict[str, LimitSlider] = {
            "max_batch_size": LimitSlider(
                "max_batch_size", 1, 64, describe=lambda v: f"{v:g} sequences",
                tip="Sequences decoded together per step. More: more tokens/s overall, and "
                "each step (so each request's TPOT) takes longer",
            ),
            "max_tokens_per_step": LimitSlider(
                "max_tokens_per_step", 16, 2048, step=16, describe=lambda v: f"{v:g} tokens",
                tip="The step's token budget: decode tokens plus prompt chunks. Larger: prompts "
                "get through faster (TTFT), and a step carrying a chunk stalls everyone's TPOT",
            ),
            "max_wait_ms": LimitSlider(
                "max_wait_ms", 0, 500, describe=lambda v: f"{v:g} ms",
                tip="How long a lone request is held hoping for company to batch with",
            ),
            "kv_blocks": LimitSlider(
                "kv_blocks", 1, 1, describe=self._describe_blocks,
                tip="The KV pool's usable blocks. When they run out, a running sequence is "
                "preempted (recomputed later)",
            ),
        }  # fmt: skip
        titles = ("Max batch size", "Max tokens / step", "Max wait", "KV pool")
        for i, (title, slider) in enumerate(zip(titles, self.sliders.values(), strict=True)):
            grid_layout.addWidget(QLabel(title), i // 2, 2 * (i % 2))
            grid_layout.addWidget(slider, i // 2, 2 * (i % 2) + 1)
            slider.moved.connect(self._slider_moved)

    def _describe_blocks(self, blocks: float) -> str:
        return f"{blocks:g} blocks = {blocks * self._block_size:,.0f} tokens"

    def set_engine(self, limits: dict[str, float], kv_blocks_total: int, block_size: int) -> None:
        """A model loaded: the KV slider's range and every slider's position (no signal)."""
        self._block_size = max(1, block_size)
        self.sliders["kv_blocks"].set_range(1, max(1, kv_blocks_total))
        self.sync({"kv_blocks": kv_blocks_total, **limits})

    def sync(self, limits: dict[str, float]) -> None:
        """Show the limits in force (no signal); a slider the user holds is left alone."""
        for key, value in limits.items():
            slider = self.sliders.get(key)
            if slider is not None and not slider.slider.isSliderDown():
                slider.set_value(float(value))

    def _slider_moved(self, key: str, value: float) -> None:
        self.changed.emit({key: value if key == "max_wait_ms" else int(value)})
