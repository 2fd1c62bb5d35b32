"""Errors answered in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``:
the one exception every route raises for a refusal, and the body it answers with (a stream's
error event carries the same body)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class HTTPError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, kind: str | None = None,
        code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.message, self.kind, self.param, self.code),
            status_code=self.status,
            headers=self.headers,
        )


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
