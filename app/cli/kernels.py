"""``infersight kernels``: the kernel verdicts this machine keeps (which path each layer shape
runs, ours or torch's, as timed: :mod:`engine.hardware.verdicts`), and ``--retime``, which
forgets them so that the next load times them again."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_kernels_parser(sub: Any) -> None:
    p = sub.add_parser(
        "kernels",
        help="the kernel verdicts kept for this machine (ours or torch's, per layer shape)",
    )
    p.add_argument(
        "--retime", action="store_true",
        help="forget this machine's verdicts: the next load times every shape again",
    )  # fmt: skip
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_kernels)


def cmd_kernels(args: argparse.Namespace) -> int:
    from engine.hardware import verdicts

    if args.retime:
        gone = verdicts.forget_this_machine()
        print(f"forgot {gone} kernel verdicts of this machine; the next load times them again")
        return 0
    mine = verdicts.kept_here()
    if args.json:
        print(json.dumps(mine, indent=1, sort_keys=True))
        return 0
    if not mine:
        print("no kernel verdicts kept for this machine yet: a load times what it needs")
    print("each shape's best timings, and the path they give at no slack (a load may allow ours "
          "more where the C decode step would run it: 1.25x torch's time, not counting what a "
          "call from Python costs ours)")  # fmt: skip
    for build, shapes in sorted(mine.items()):
        print(build)
        for shape, figures in sorted(shapes.items()):
            print(f"  {shape}: {_verdict(figures)}")
    return 0


def _verdict(figures: dict[str, Any]) -> str:
    """One shape's timing and the path it gives (at no slack)."""
    from engine.hardware.verdicts import read_timing

    timing = read_timing(figures)
    if timing is None:
        return "unreadable (timed again by the next load)"
    call = f" ({timing.call_ms:.3f} of it a call)" if timing.call_ms else ""
    noise = f", noise {timing.noise:.0%}" if timing.noise else ""
    path = "ours" if timing.ours else "torch's"
    return f"ours {timing.ours_ms:.3f} ms{call}, torch's {timing.torch_ms:.3f} ms{noise}: {path}"
