"""schemathesis's hooks for fuzzing ``infersight serve`` (``SCHEMATHESIS_HOOKS=checks.fuzz_hooks``):
the check that every 4xx says what was wrong in OpenAI's error shape."""

from __future__ import annotations

from typing import Any

import schemathesis


@schemathesis.check
def openai_error_shape(ctx: Any, response: Any, case: Any) -> None:
    """A 4xx answers ``{"error": {"message": str, "type": str, …}}``, as OpenAI's API does."""
    if not 400 <= response.status_code < 500:
        return
    try:
        body = response.json()
    except ValueError:
        raise AssertionError(f"{response.status_code} with a body that is not JSON") from None
    error = body.get("error") if isinstance(body, dict) else None
    shaped = isinstance(error, dict) and all(
        isinstance(error.get(k), str) for k in ("message", "type")
    )
    assert shaped, f"{response.status_code} not in OpenAI's error shape: {response.text[:200]}"
