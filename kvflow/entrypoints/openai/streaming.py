"""Server-sent events: the text deltas a stream may send, and the response that carries them.

`TextStreamer` is shared by the HTTP routes and `kvflow chat` (cli_chat.py): the output's text is
cumulative, and a tail that may still become a stop string must not reach the client yet.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from kvflow.entrypoints.openai import protocol as p
from kvflow.sampling.detokenizer import stop_string_holdback


class TextStreamer:
    """Cuts cumulative output text into deltas that never leak part of a stop string.

    While running, a tail that is a proper prefix of a stop string is held back (the next
    token may complete it, and then the engine removes it); once finished, all is flushed.
    """

    def __init__(self, stop: list[str]) -> None:
        self.stop, self.sent = stop, 0

    def delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else len(text) - stop_string_holdback(text, self.stop)
        if end <= self.sent:
            return ""
        chunk, self.sent = text[self.sent:end], end
        return chunk


class _AbortingStreamingResponse(StreamingResponse):
    """Closes its generator however the response ends, so the engine request is aborted now.

    Without this, a write to a vanished client raises out of Starlette's loop and leaves the
    generator suspended until garbage collection, holding KV blocks meanwhile.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


def sse(payload: p.OpenAIModel) -> str:
    exclude = {"usage"} if getattr(payload, "usage", 0) is None else None
    return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return _AbortingStreamingResponse(events, media_type="text/event-stream",
                                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
