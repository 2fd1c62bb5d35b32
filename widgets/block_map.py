"""The KV block map: every block of the paged pool as a cell, coloured by the request that owns
it. Free blocks are dark. It takes a plain list of owners, one per block (``None`` = free)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from PySide6.QtCore import QPoint, QRect, QSize, Qt
from PySide6.QtGui import QColor, QHelpEvent, QImage, QPainter, QPaintEvent
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

FREE = QColor(40, 44, 52)
BORDER = QColor(24, 26, 30)


def owner_colour(owner: str) -> QColor:
    """A stable, well spread colour for a request id."""
    hue = zlib.crc32(owner.encode()) * 0.618033988749895 % 1.0
    return QColor.fromHsvF(hue, 0.65, 0.95)


class KVBlockMap(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._owners: list[str | None] = []
        self._image = QImage()
        self.setMinimumSize(120, 60)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.setToolTip("KV cache blocks; each cell is one block, coloured by its request")

    # -- data ------------------------------------------------------------------------------
    def set_owners(self, owners: Sequence[str | None]) -> None:
        owners = list(owners)
        if owners == self._owners:
            return
        self._owners = owners
        self._image = QImage()  # re-rendered lazily at the current size
        self.update()

    @property
    def total_cells(self) -> int:
        return len(self._owners)

    @property
    def used_cells(self) -> int:
        return sum(1 for o in self._owners if o is not None)

    def owners(self) -> list[str | None]:
        return list(self._owners)

    # -- geometry --------------------------------------------------------------------------
    def _grid(self) -> tuple[int, int, int]:
        """(columns, rows, cell size in pixels) that fit every block in the widget."""
        n = max(1, len(self._owners))
        w, h = max(1, self.width()), max(1, self.height())
        cell = max(1, int((w * h / n) ** 0.5))
        while cell > 1 and (w // cell) * (h // cell) < n:
            cell -= 1
        cols = max(1, w // cell)
        return cols, -(-n // cols), cell

    def block_at(self, pos: QPoint) -> int | None:
        cols, _, cell = self._grid()
        index = (pos.y() // cell) * cols + pos.x() // cell
        return index if pos.x() < cols * cell and 0 <= index < len(self._owners) else None

    # -- painting --------------------------------------------------------------------------
    def sizeHint(self) -> QSize:
        return QSize(320, 120)

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.fillRect(self.rect(), BORDER)
        if not self._owners:
            painter.setPen(QColor(160, 160, 160))
            painter.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, "no model loaded")
            return
        if self._image.isNull() or self._image.size() != self.size():
            self._image = self._render()
        painter.drawImage(0, 0, self._image)

    def _render(self) -> QImage:
        image = QImage(self.size(), QImage.Format.Format_RGB32)
        image.fill(BORDER)
        cols, _, cell = self._grid()
        gap = 1 if cell >= 4 else 0
        painter = QPainter(image)
        colours: dict[str, QColor] = {}
        for index, owner in enumerate(self._owners):
            row, col = divmod(index, cols)
            colour = FREE if owner is None else colours.setdefault(owner, owner_colour(owner))
            painter.fillRect(QRect(col * cell, row * cell, cell - gap, cell - gap), colour)
        painter.end()
        return image

    def event(self, event: object) -> bool:
        if isinstance(event, QHelpEvent) and event.type() == QHelpEvent.Type.ToolTip:
            index = self.block_at(event.pos())
            if index is None:
                QToolTip.showText(event.globalPos(), self.toolTip(), self)
            else:
                owner = self._owners[index] or "free"
                QToolTip.showText(event.globalPos(), f"block {index}: {owner}", self)
            return True
        return super().event(event)  # type: ignore[arg-type]
