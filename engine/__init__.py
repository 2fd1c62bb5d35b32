"""Infersight's inference engine: pure Python + torch, no Qt.

Usable from a script, a test, the command line or the desktop app::

    import engine
    from engine import SamplingParams

    eng = engine.load("path/to/hf-folder", precision="fp32")
    for event in eng.generate(eng.tokenizer.encode("Hello"), SamplingParams(max_new_tokens=16)):
        print(event.text, end="")

The names below are imported on first use (PEP 562), so ``import engine`` costs nothing
until one is asked for: the errors need no torch, the rest do.

Where things are (each folder's ``__init__`` says more): ``core/`` the step and the request
API; ``model/`` the transformer; ``kv_cache/``; ``kernels/`` the fast paths beside their
fallbacks; ``quant/``; ``speculative/``; ``hardware/`` the probes; ``loader/`` a folder to
an engine; ``store/`` models on disk; ``bench/`` speed; ``evals/`` quality.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.errors import (
    InfersightError,
    InvalidRequestError,
    ModelLoadError,
    UnsupportedModelError,
)

if TYPE_CHECKING:
    from engine.core.config import EngineConfig
    from engine.core.engine import LLMEngine
    from engine.core.sampling import SamplingParams
    from engine.loader.load import load_model as load

#: public name -> (module, attribute), imported on first use
_LAZY = {
    "LLMEngine": ("engine.core.engine", "LLMEngine"),
    "EngineConfig": ("engine.core.config", "EngineConfig"),
    "SamplingParams": ("engine.core.sampling", "SamplingParams"),
    "load": ("engine.loader.load", "load_model"),
}

__all__ = [
    "EngineConfig",
    "InfersightError",
    "InvalidRequestError",
    "LLMEngine",
    "ModelLoadError",
    "SamplingParams",
    "UnsupportedModelError",
    "load",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later lookups skip this function
    return value
