"""The soak's plots (``soak.json`` → PNGs): each server's RSS, and its KV blocks held and
kept as reusable prefixes, over the run; and the p99 TTFT and TPOT of each interval. Drawn
with pyqtgraph offscreen (the app's own plotting), 900×360 each.

``python -m checks.soak_plot soak-out/soak.json docs/soak``"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

COLOURS = ["#4c9be8", "#e8a33d", "#5fbf6f", "#d75f5f"]
PLOTS = {  # file → (title, unit, [(series name, figure)])
    "soak-rss.png": ("Server RSS", "MiB", [("{server}", "rss_mib")]),
    "soak-kv.png": ("KV blocks", "blocks", [("{server} held", "kv_used"),
                                            ("{server} cached", "kv_cached")]),
    "soak-latency.png": ("p99 latency per 10 s", "ms", [("{server} TTFT", "ttft_p99_ms"),
                                                         ("{server} TPOT", "tpot_p99_ms")]),
}  # fmt: skip


def draw(report: dict[str, Any], out: Path) -> list[Path]:
    import pyqtgraph as pg
    import pyqtgraph.exporters
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([])
    pg.setConfigOptions(antialias=True, background="w", foreground="k")
    samples = report["samples"]
    minutes = [s["t_s"] / 60 for s in samples]
    written = []
    for file, (title, unit, series) in PLOTS.items():
        plot = pg.PlotWidget(title=title)
        plot.resize(900, 360)
        plot.setLabel("left", unit)
        for axis in ("left", "bottom"):  # every tick labelled, four digits included
            plot.getAxis(axis).setStyle(hideOverlappingLabels=False, autoExpandTextSpace=True)
            plot.getAxis(axis).enableAutoSIPrefix(False)
        plot.setLabel("bottom", "minutes")
        plot.addLegend(offset=(10, 10))
        colour = iter(COLOURS * 4)
        for server in report["servers"]:
            for name, figure in series:
                ys = [s[server][figure] for s in samples]
                xs = [x for x, y in zip(minutes, ys, strict=True) if y is not None]
                ys = [y for y in ys if y is not None]
                plot.plot(xs, ys, name=name.format(server=server),
                          pen=pg.mkPen(next(colour), width=2))  # fmt: skip
        plot.show()  # laid out (offscreen), so that the axes size their labels' text
        app.processEvents()
        exporter = pyqtgraph.exporters.ImageExporter(plot.getPlotItem())
        exporter.parameters()["width"] = 900
        path = out / file
        exporter.export(str(path))
        written.append(path)
    del app
    return written


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2:
        print("usage: python -m checks.soak_plot SOAK_JSON OUT_DIR", file=sys.stderr)
        return 2
    out = Path(args[1])
    out.mkdir(parents=True, exist_ok=True)
    for path in draw(json.loads(Path(args[0]).read_text(encoding="utf-8")), out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
