"""What every endpoint shares: bounded JSON bodies and OpenAI-shaped error responses."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.headers = headers or {}

    def response(self) -> Response:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


async def api_error_handler(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request body as JSON; 413 past `max_bytes` (checked while reading), 400 if malformed."""
    too_large = ApiError(413, f"request body is over the limit of {max_bytes} bytes; "
                              "send a shorter prompt or raise the server's body limit")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise too_large
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc}); send a JSON object") from None


def json_response(data: Any, status: int = 200) -> Response:
    """JSON that keeps non-finite floats (Python's json reads them back) instead of failing."""
    return Response(json.dumps(data), status_code=status, media_type="application/json")
