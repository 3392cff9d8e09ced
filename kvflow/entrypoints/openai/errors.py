"""Errors in OpenAI's shape: {"error": {message, type, param, code}} with the status an SDK maps.

Split from server.py: the exception handlers the app installs, the one function that builds
an error body, and the exception that marks a client gone mid-response.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.engine.inputs import check_unicode
from kvflow.entrypoints.async_engine import EngineDeadError, EngineOverloadedError, EngineStepError
from kvflow.entrypoints.openai import protocol as p
from kvflow.entrypoints.openai.structured import name_field
from kvflow.structured_output.backend import StructuredOutputError

_FIELD = re.compile(r"[A-Za-z_]+")
_KNOWN_PARAMS = (set(p.CompletionRequest.model_fields) | set(p.ChatCompletionRequest.model_fields)
                 | {"stop_token_ids", "request_id", "input", "dimensions", "normalize"})  # the last: /v1/embeddings


class ClientDisconnected(Exception):
    """The client closed the connection before its response was complete."""


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: int | str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    # A message may quote the request (a model name, a prompt): a lone surrogate in it would make
    # the JSON encoder itself fail, turning a 4xx into a 500. Escape such characters instead.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    body = p.ErrorResponse(error=p.ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def engine_failure(exc: EngineDeadError | EngineStepError) -> tuple[int, str]:
    """The status and code of an engine failure: the same for a request answered whole and for a
    stream's error event (which can no longer change its status)."""
    return (503, "engine_dead") if isinstance(exc, EngineDeadError) else (500, "engine_step_failed")


def stream_error_event(exc: EngineDeadError | EngineStepError) -> p.ErrorResponse:
    """What a stream sends when the engine fails mid-answer, before its [DONE]."""
    return p.ErrorResponse(error=p.ErrorInfo(message=str(exc), type="server_error", code=engine_failure(exc)[1]))


def check_text(text: str, param: str) -> None:
    """engine.inputs.check_unicode as a 400 naming `param` (JSON allows lone-surrogate escapes and
    Python keeps them; caught here, the client learns which field is wrong instead of getting a 500)."""
    try:
        check_unicode(text, param)
    except ValueError as exc:
        raise p.InvalidRequestError(str(exc), param=param) from None


def _param_of(message: str) -> str | None:
    """Validation messages start with the field name ("temperature must be ..."); recover it."""
    m = _FIELD.match(message)
    return m.group(0) if m and m.group(0) in _KNOWN_PARAMS else None


def add_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's shape, with the status an OpenAI client expects."""

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "")
            return error_response(400, f"Malformed JSON in the request body: {detail}".rstrip(": "))
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        messages = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
                             for e in errors)
        return error_response(400, messages or "invalid request", param=loc[0] if loc else None)

    @app.exception_handler(p.InvalidRequestError)
    async def on_invalid(_: Request, exc: p.InvalidRequestError) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status < 500 else "server_error"
        return error_response(exc.status, exc.message, type_, exc.param, exc.code)

    @app.exception_handler(ValueError)
    async def on_value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc), param=_param_of(str(exc)))

    @app.exception_handler(EngineOverloadedError)
    async def on_overload(_: Request, exc: EngineOverloadedError) -> JSONResponse:
        return error_response(503, str(exc), "server_overloaded", code="overloaded",
                              headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(EngineStepError)
    async def on_engine_failure(_: Request, exc: EngineDeadError | EngineStepError) -> JSONResponse:
        status, code = engine_failure(exc)
        return error_response(status, str(exc), "server_error", code=code)

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not a bad request: still OpenAI's shape, so a client's SDK raises InternalServerError
        # with a message. Starlette logs the traceback after this answer is sent.
        return error_response(500, f"The server had an error processing the request: {type(exc).__name__}",
                              "server_error", code="internal_error")

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), type_, code=getattr(exc, "openai_code", None),
                              headers=getattr(exc, "headers", None))


@contextlib.contextmanager
def structured_output_errors(field: str | None) -> Iterator[None]:
    """A constraint that does not compile (raised when the request is submitted) as a 400 naming
    the request field it came from."""
    try:
        yield
    except StructuredOutputError as exc:
        raise p.InvalidRequestError(name_field(str(exc), field), param=field) from None
