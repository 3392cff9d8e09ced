"""A bound on request bodies, checked before a body is read whole.

uvicorn sets no limit, and FastAPI reads the whole body into memory before validating it,
so one client sending gigabytes could exhaust the server's memory for everyone. No useful
request comes near the default: a whole context of token ids, or of text escaped as JSON,
is a few MiB even for 128k-token models.
"""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException

from kvflow.entrypoints.openai.errors import error_response

DEFAULT_MAX_REQUEST_BYTES = 32 << 20


def _too_large(max_bytes: int) -> str:
    return f"The request body is larger than this server accepts ({max_bytes} bytes; --max-request-bytes)."


class RequestTooLarge(HTTPException):
    """Raised from `receive` once a chunked body passes the limit (FastAPI re-raises HTTPExceptions)."""

    openai_code = "request_too_large"  # the error's `code`, as for a declared length

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, _too_large(max_bytes), headers={"Connection": "close"})


class BodyLimitMiddleware:
    """Plain ASGI: 413 in OpenAI's shape for a body over `max_bytes`.

    A declared Content-Length over the limit is refused before any byte is read; a chunked
    body is counted as it arrives and refused once it passes the limit. The latter raises
    Starlette's HTTPException from `receive`, which FastAPI lets through its body parsing to
    the app's error handlers, so the answer keeps the error shape.
    """

    def __init__(self, app: Any, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            response = error_response(413, _too_large(self.max_bytes), code="request_too_large",
                                      headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)
