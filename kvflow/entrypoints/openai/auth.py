"""The API key: `kvflow serve --api-key K` makes /v1 and the tokenizer's routes want
`Authorization: Bearer K`, as vLLM's `--api-key` does (/health, /metrics and /version stay open
for probes and scrapers; the dashboard takes the key itself, see dashboard.py)."""

from __future__ import annotations

import secrets
from typing import Any

from kvflow.entrypoints.openai.errors import error_response
from kvflow.entrypoints.openai.tokenization import ROUTES as TOKENIZATION_ROUTES


class APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware): checks the key of /v1 and the tokenizer's routes before
    any parsing, leaves streams alone."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1") or path in TOKENIZATION_ROUTES) \
                and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                          code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
