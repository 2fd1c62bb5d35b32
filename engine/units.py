"""How Infersight writes a size for people: one rule for the picker, the Hub page, a pull's
progress and its errors."""

from __future__ import annotations


def format_size(nbytes: float) -> str:
    """``3.0 MiB``, ``5.00 GiB``."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"
