"""The KV block map: every block of the paged pool as a cell.

With prefix caching a block can be held by several requests at once (a shared prompt prefix,
read-only), and a block no request holds may still keep a cached prefix that a later request
can reuse until the pool evicts it. So a cell is one of four kinds:

* held by one request: that request's colour (:func:`owner_colour`);
* shared by several: diagonal stripes of its owners' colours, owners sorted so the drawing is
  stable. Cells of 2–3 px get one-pixel stripes (the owners' colours alternate pixel by
  pixel); a 1 px cell cannot hold two colours, so it takes its first owner's colour lightened
  towards white, which no single-owner cell has;
* free but cached: :data:`CACHED`, a muted slate teal, darker and greyer than any owner colour
  and lighter than an empty cell;
* empty: :data:`FREE`, dark.

It takes plain data, one entry per block: the tuple of request ids holding it and whether a
block held by none still holds a cached prefix.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from PySide6.QtCore import QPoint, QRect, QSize, Qt
from PySide6.QtGui import QBrush, QColor, QHelpEvent, QImage, QPainter, QPaintEvent
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

FREE = QColor(40, 44, 52)
CACHED = QColor(64, 104, 112)
BORDER = QColor(24, 26, 30)


def owner_colour(owner: str) -> QColor:
    """A stable, well spread colour for a request id."""
    hue = zlib.crc32(owner.encode()) * 0.618033988749895 % 1.0
    return QColor.fromHsvF(hue, 0.65, 0.95)


def _stripes(colours: Sequence[QColor], band: int) -> QImage:
    """A tile of 45° stripes ``band`` px wide cycling through ``colours``. Its side is one
    full cycle, so the tile repeats seamlessly in both directions."""
    side = band * len(colours)
    tile = QImage(side, side, QImage.Format.Format_RGB32)
    for y in range(side):
        for x in range(side):
            tile.setPixelColor(x, y, colours[(x + y) // band % len(colours)])
    return tile


def _lightened(colour: QColor) -> QColor:
    """``colour`` halfway to white: a shared block drawn in a single pixel."""
    return QColor(
        (colour.red() + 255) // 2, (colour.green() + 255) // 2, (colour.blue() + 255) // 2
    )


class KVBlockMap(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._owners: list[tuple[str, ...]] = []
        self._cached: list[bool] = []
        self._image = QImage()
        self.setMinimumSize(120, 60)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.setToolTip(
            "KV cache blocks, one cell each: coloured by the request holding it, striped in "
            "its owners' colours when several share it (a cached prefix), slate teal when "
            "free but still holding a reusable cached prefix, dark when empty"
        )

    # -- data ------------------------------------------------------------------------------
    def set_blocks(self, owners: Sequence[tuple[str, ...]], cached: Sequence[bool] = ()) -> None:
        """``owners[i]``: the requests holding block i (empty: none); ``cached[i]``: whether
        block i, if held by none, still holds a reusable prefix (an empty ``cached``: none
        does). A held block's flag is kept but does not change how it is drawn."""
        new_owners = [tuple(sorted(o)) for o in owners]
        new_cached = [bool(c) for c in cached] if cached else [False] * len(new_owners)
        if len(new_cached) != len(new_owners):
            raise ValueError(f"{len(new_cached)} cached flags for {len(new_owners)} blocks")
        if new_owners == self._owners and new_cached == self._cached:
            return
        self._owners, self._cached = new_owners, new_cached
        self._image = QImage()  # re-rendered lazily at the current size
        self.update()

    @property
    def total_cells(self) -> int:
        return len(self._owners)

    @property
    def used_cells(self) -> int:
        """Blocks held by at least one request."""
        return sum(1 for o in self._owners if o)

    @property
    def shared_cells(self) -> int:
        """Blocks held by two or more requests."""
        return sum(1 for o in self._owners if len(o) > 1)

    @property
    def cached_cells(self) -> int:
        """Blocks held by none that still hold a reusable cached prefix."""
        return sum(1 for o, c in zip(self._owners, self._cached, strict=True) if c and not o)

    def owners(self) -> list[tuple[str, ...]]:
        return list(self._owners)

    def cached(self) -> list[bool]:
        return list(self._cached)

    def describe(self, index: int) -> str:
        """What the tooltip says about block ``index``."""
        owners = self._owners[index]
        if len(owners) > 1:
            return f"block {index}: shared by {', '.join(owners)}"
        if owners:
            return f"block {index}: {owners[0]}"
        if self._cached[index]:
            return f"block {index}: cached prefix (free, reusable)"
        return f"block {index}: empty"

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
        band = max(2, (cell - gap) // 4) if cell >= 4 else 1  # stripe width, see the docstring
        painter = QPainter(image)
        colours: dict[str, QColor] = {}
        shared: dict[tuple[str, ...], QBrush | QColor] = {}
        for index, (owners, cached) in enumerate(zip(self._owners, self._cached, strict=True)):
            row, col = divmod(index, cols)
            rect = QRect(col * cell, row * cell, cell - gap, cell - gap)
            if len(owners) > 1:
                fill = shared.get(owners)
                if fill is None:
                    owned = [colours.setdefault(o, owner_colour(o)) for o in owners]
                    fill = shared[owners] = (
                        QBrush(_stripes(owned, band)) if cell > 1 else _lightened(owned[0])
                    )
                if isinstance(fill, QBrush):
                    painter.setBrushOrigin(rect.topLeft())  # every cell's stripes alike
                painter.fillRect(rect, fill)
            elif owners:
                painter.fillRect(rect, colours.setdefault(owners[0], owner_colour(owners[0])))
            else:
                painter.fillRect(rect, CACHED if cached else FREE)
        painter.end()
        return image

    def event(self, event: object) -> bool:
        if isinstance(event, QHelpEvent) and event.type() == QHelpEvent.Type.ToolTip:
            index = self.block_at(event.pos())
            text = self.toolTip() if index is None else self.describe(index)
            QToolTip.showText(event.globalPos(), text, self)
            return True
        return super().event(event)  # type: ignore[arg-type]
