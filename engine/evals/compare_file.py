"""The A/B comparison file: what the app saves and opens and ``infersight eval compare --json``
writes, the format tag and one or more comparisons (:func:`document`), and the checks a file
read back passes before it is shown (:func:`read_document`).
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError

FORMAT = "infersight-ab/1"


def document(comparisons: list[dict[str, Any]]) -> dict[str, Any]:
    """What a file holds: the format tag and one or more comparisons."""
    return {"format": FORMAT, "comparisons": comparisons}


def read_document(data: Any) -> list[dict[str, Any]]:
    """The comparisons of a saved file's parsed JSON; a clear error for anything else,
    checked deep enough that showing a comparison cannot fail on its shape."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InvalidRequestError(
            f"this is not an A/B comparison file (expected format {FORMAT!r}); save one from the "
            "A/B lab or write one with `infersight eval compare --json`"
        )
    comparisons = data.get("comparisons")
    if not isinstance(comparisons, list) or not comparisons:
        raise InvalidRequestError("the comparison file holds no comparison")
    for i, c in enumerate(comparisons):
        problem = _shape_problem(c)
        if problem:
            raise InvalidRequestError(
                f"comparison {i + 1} of the file is damaged or from another program: {problem}"
            )
    return comparisons


def _shape_problem(c: Any) -> str | None:
    """What is wrong with one comparison's shape, or ``None``."""
    if not isinstance(c, dict):
        return "it is not an object"
    for key in ("a", "b", "columns", "divergence", "summary"):
        if not isinstance(c.get(key), dict):
            return f"{key!r} is missing or not an object"
    for side in ("a", "b"):
        info, column = c[side], c["columns"].get(side)
        pieces, ids = info.get("pieces"), info.get("token_ids")
        if not isinstance(pieces, list) or not all(isinstance(p, str) for p in pieces):
            return f"{side}.pieces must be a list of strings"
        if not isinstance(ids, list) or len(ids) != len(pieces):
            return f"{side}.token_ids must be a list as long as {side}.pieces"
        if not isinstance(column, dict):
            return f"columns.{side} is missing"
        for key in ("kl", "p_a", "p_b", "top_a", "top_b"):
            values = column.get(key)
            if not isinstance(values, list) or len(values) != len(pieces):
                return f"columns.{side}.{key} must be a list with one entry per token"
        noise = column.get("noise_kl")
        if noise is not None and (not isinstance(noise, list) or len(noise) != len(pieces)):
            return f"columns.{side}.noise_kl must be null or a list with one entry per token"
        numbers = column["kl"] + column["p_a"] + column["p_b"] + (noise or [])
        if not all(isinstance(v, (int, float)) for v in numbers):
            return f"columns.{side} holds figures that are not numbers"
    return _speculation_problem(c["summary"].get("speculative"))


def _speculation_problem(spec: Any) -> str | None:
    """What is wrong with ``summary.speculative`` (absent, or without ``measured``: fine)."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        return "summary.speculative is not an object"
    measured = spec.get("measured")
    if measured is None:
        return None
    if not isinstance(measured, dict):
        return "summary.speculative.measured is not an object"
    for key in ("token_acceptance", "acceptance_rate", "mean_acceptance_length"):
        value = measured.get(key)
        if value is not None and not isinstance(value, (int, float)):
            return f"summary.speculative.measured.{key} is not a number"
    return None
