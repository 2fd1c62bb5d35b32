"""Errors answered in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``:
the one exception every route raises for a refusal, and the body it answers with (a stream's
error event carries the same body)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel


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


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """What every refusal answers with (the OpenAPI document names it for each status)."""

    error: ErrorDetail


#: the refusals every route may answer with, in the OpenAPI document
REFUSALS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": said}
    for status, said in ((400, "the request is not one this server takes: the field is named"),
                         (401, "no API key, or not this server's"),
                         (404, "no such route, or no such model"),
                         (405, "the route does not take this method"),
                         (413, "the body is larger than the server's limit"),
                         (429, "rate-limited"),
                         (503, "the queue is full, or the server is unhealthy"))
}  # fmt: skip


def document(app: FastAPI) -> None:
    """The app's OpenAPI document as the routes answer: its refusals in OpenAI's shape
    (:data:`REFUSALS`), never FastAPI's 422 (validation failures answer 400)."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    responses = operation.get("responses", {})
                    responses.pop("422", None)
                    for status in REFUSALS:  # JSON whatever the route's own answers are
                        if str(status) in responses:
                            responses[str(status)]["content"] = error
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
