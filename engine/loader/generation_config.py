"""A model folder's ``generation_config.json``: its end-of-sequence ids and the model's own
sampling defaults, read the way transformers' ``generate`` reads them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from engine.core.sampling import SamplingParams
from engine.errors import InvalidRequestError, ModelLoadError

log = logging.getLogger(__name__)


def read_generation_config(folder: Path) -> dict[str, Any]:
    """``generation_config.json`` as a dict; ``{}`` when the folder has none."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return raw if isinstance(raw, dict) else {}


def generation_config_eos(folder: Path) -> list[int]:
    eos = read_generation_config(folder).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


#: what transformers' ``generate`` uses for a key that ``generation_config.json`` leaves out
HF_SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


def generation_config_sampling(folder: Path) -> dict[str, Any]:
    """The model's own sampling defaults as :class:`SamplingParams` keyword arguments
    (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, and
    ``max_new_tokens`` when the file sets it), read the way transformers' ``generate`` reads
    ``generation_config.json``:

    * no file, or ``do_sample`` false or absent: greedy (temperature 0), as in transformers;
      a ``repetition_penalty`` still applies;
    * ``do_sample`` true: the file's values, and for a key it leaves out (or sets to null)
      transformers' default: temperature 1.0, top-k 50, top-p 1.0. So top-k 50 applies only
      when the file asks for sampling, exactly when transformers would apply it; ``top_k: 0``
      turns it off.

    Values out of range are ignored with a warning (the model then runs greedy)."""
    raw = read_generation_config(folder)
    greedy: dict[str, Any] = {
        "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0
    }  # fmt: skip

    def value(key: str, default: Any) -> Any:
        v = raw.get(key)
        return default if v is None else v

    try:
        out = {**greedy, "repetition_penalty": float(value("repetition_penalty", 1.0))}
        if raw.get("do_sample") is True:
            hf = HF_SAMPLING_DEFAULTS
            out["temperature"] = float(value("temperature", hf["temperature"]))
            out["top_k"] = int(value("top_k", hf["top_k"]))
            out["top_p"] = float(value("top_p", hf["top_p"]))
            out["min_p"] = float(value("min_p", 0.0))
        if isinstance(raw.get("max_new_tokens"), int):
            out["max_new_tokens"] = raw["max_new_tokens"]
        SamplingParams(**out)
    except (InvalidRequestError, TypeError, ValueError) as exc:
        log.warning("ignoring the sampling in %s: %s", folder / "generation_config.json", exc)
        return greedy
    return out
