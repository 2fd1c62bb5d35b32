"""The expert heat map: which experts a mixture of experts' tokens go to, layer by layer.

Each row is a layer of experts, each column an expert; a cell's colour is the share of that
layer's recent routed tokens that went to the expert (the tokens routed between frames,
decayed by :data:`DECAY` a frame, so the map follows what the model routes now). A uniform
router shows an even field; hot columns are the experts a workload leans on. It takes the
snapshot's cumulative counts (:attr:`engine.core.metrics.MetricsSnapshot.expert_tokens`) and
draws their changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from widgets.plots import make_plot

#: how much of the heat of earlier frames a frame keeps
DECAY = 0.8


class ExpertHeatMap(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.plot = make_plot("Expert load", "layer of experts", "expert")
        self.image = pg.ImageItem(axisOrder="row-major")
        self.image.setColorMap(pg.colormap.get("inferno"))
        self.plot.addItem(self.image)
        col = QVBoxLayout(self)
        col.setContentsMargins(0, 0, 0, 0)
        col.addWidget(self.label)
        col.addWidget(self.plot, 1)
        self._last: np.ndarray | None = None
        self._heat: np.ndarray | None = None
        self.layers: tuple[int, ...] = ()
        #: per layer, the share of its recent tokens each expert took (rows sum to 1 where
        #: any token was routed); what the image shows
        self.shares = np.zeros((0, 0))
        self.set_load((), ())

    def set_load(self, layers: tuple[int, ...], tokens: Sequence[Sequence[int]]) -> None:
        """The layers of experts and the tokens routed to each expert of each since the load."""
        if not layers:
            self._last = self._heat = None
            self.layers, self.shares = (), np.zeros((0, 0))
            self.plot.setVisible(False)
            self.label.setText(
                "A dense model: no experts. Load a mixture of experts (Qwen3-MoE, Qwen2-MoE, "
                "Mixtral) to see which experts its tokens go to, layer by layer."
            )
            return
        now = np.asarray(tokens, dtype=np.float64)
        if self._last is None or self._last.shape != now.shape or layers != self.layers:
            self._last, self._heat = np.zeros_like(now), np.zeros_like(now)
        assert self._heat is not None
        self._heat = DECAY * self._heat + np.maximum(now - self._last, 0.0)
        self._last, self.layers = now, layers
        total = self._heat.sum(axis=1, keepdims=True)
        self.shares = np.divide(self._heat, total, out=np.zeros_like(self._heat), where=total > 0)
        self.plot.setVisible(True)
        self.image.setImage(self.shares, levels=(0.0, max(float(self.shares.max()), 1e-9)))
        experts = now.shape[1]
        hottest = int(self.shares.sum(axis=0).argmax())
        self.label.setText(
            f"{len(layers)} layers of {experts} experts · {int(now.sum()):,} routings so far · "
            f"hottest lately: expert {hottest}"
        )
