"""Errors in OpenAI's shape: what the HTTP face answers when a request cannot be served."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import ValidationError

RETRY_AFTER_S = 1  # what a 429 (a full waiting line) asks the client to wait


class APIError(Exception):
    """An answer in OpenAI's error shape. `code`: OpenAI's string code where it has one for the case (such as
    "context_length_exceeded"), else the HTTP status, as vLLM gives it."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers
        self.code = code

    def response(self) -> JSONResponse:
        code = self.code if self.code is not None else self.status
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def invalid_body(e: ValidationError) -> APIError:
    """The first problem pydantic found in a request body, as a 400 naming the field. A field Strata does not
    honour is refused by name rather than ignored (docs/SERVING.md lists the accepted ones)."""
    err = e.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or None
    if err["type"] == "extra_forbidden":
        return APIError(400, f"{field}: Strata does not support this field, so it refuses the request rather than "
                             "ignore it (docs/SERVING.md lists the fields it accepts)", param=field)
    return APIError(400, f"{field}: {err['msg']}", param=field)
