"""Where Infersight keeps what it makes on this machine: one cache folder for models,
downloads, built kernels and measured verdicts."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """Infersight's cache folder: ``$INFERSIGHT_HOME``, else the platform's user cache."""
    override = os.environ.get("INFERSIGHT_HOME")
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("infersight", appauthor=False))
