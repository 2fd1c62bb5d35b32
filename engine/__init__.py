"""Infersight's inference engine: pure Python + torch, no Qt.

Usable from a script, a test, the command line or the desktop app::

    from engine import LLMEngine, SamplingParams

    eng = LLMEngine.load("path/to/hf-folder", precision="fp32")
    for event in eng.generate(eng.tokenizer.encode("Hello"), SamplingParams(max_new_tokens=16)):
        print(event.text, end="")
"""

from engine.errors import (
    InfersightError,
    InvalidRequestError,
    ModelLoadError,
    UnsupportedModelError,
)

__all__ = [
    "InfersightError",
    "InvalidRequestError",
    "ModelLoadError",
    "UnsupportedModelError",
]
