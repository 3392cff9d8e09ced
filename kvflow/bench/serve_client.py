"""One streamed /v1/completions request against any OpenAI-compatible server, timed per SSE chunk.

All timing is on the client's monotonic clock: the request starts when it is handed to the
HTTP client, and every server-sent event that carries generated tokens is stamped when its
line arrives. That is what a user of the server experiences, network and queueing included,
and it needs nothing from the server but the OpenAI wire format.

A server may hold text back (an incomplete UTF-8 sequence, a possible stop string) or, for a
model without a tokenizer, send no text at all until the end; then chunks are coarser than
tokens. Asking for `logprobs` makes OpenAI-style servers send one entry per token, so the
chunk count is checked against the token count and the caller can warn when ITLs are per
chunk rather than per token.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

try:
    import httpx
except ImportError:  # the openai client ships its HTTP stack as `httpx2`
    import httpx2 as httpx  # type: ignore[no-redef]


@dataclass
class ServeRequest:
    prompt: list[int] | str
    prompt_len: int  # as drawn; the server's own count (usage) wins when it reports one
    output_len: int


@dataclass
class ChunkInfo:
    """What one SSE `data:` line says."""

    tokens: int = 0  # generated tokens it carries (estimated as 1 for a text-only chunk)
    finished: bool = False
    prompt_tokens: int | None = None  # from a usage block
    completion_tokens: int | None = None
    error: str | None = None
    done: bool = False  # the `[DONE]` sentinel


@dataclass
class RequestRecord:
    """One request as the client saw it; `chunk_times` are the arrivals of token-carrying chunks."""

    start: float
    requested_output: int
    prompt_tokens: int
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)


def parse_event(data: str) -> ChunkInfo:
    """Interpret one SSE data payload of a /v1/completions stream."""
    data = data.strip()
    if data == "[DONE]":
        return ChunkInfo(done=True)
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        return ChunkInfo(error=f"unparseable event: {data[:200]!r}")
    if not isinstance(obj, dict):
        return ChunkInfo(error=f"unexpected event: {data[:200]!r}")
    if obj.get("error"):
        err = obj["error"]
        return ChunkInfo(error=str(err.get("message", err) if isinstance(err, dict) else err))
    info = ChunkInfo()
    usage = obj.get("usage")
    if isinstance(usage, dict):
        info.prompt_tokens = usage.get("prompt_tokens")
        info.completion_tokens = usage.get("completion_tokens")
    for choice in obj.get("choices") or []:
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
        if tokens:
            info.tokens += len(tokens)
        elif choice.get("text"):
            info.tokens += 1
        if choice.get("finish_reason") is not None:
            info.finished = True
    return info


def completion_payload(req: ServeRequest, model: str, logprobs: int | None = None) -> dict[str, Any]:
    """A streamed, greedy request that generates exactly `output_len` tokens (EOS ignored)."""
    payload: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if logprobs is not None:
        payload["logprobs"] = logprobs
    return payload


def apply_chunk(record: RequestRecord, info: ChunkInfo, now: float) -> None:
    """Fold one event into the record.

    A chunk counts as a token arrival if it carries tokens; a content-free finishing chunk
    counts only when nothing came before it (a server that streams no text at all), so a
    trailing empty 'finish' chunk does not add a fake near-zero inter-token gap.
    """
    if info.error is not None:
        record.error = info.error
        return
    if info.tokens > 0 or (info.finished and not record.chunk_times):
        record.chunk_times.append(now)
        record.output_tokens += max(info.tokens, 1)
    if info.completion_tokens is not None:
        record.output_tokens = int(info.completion_tokens)
    if info.prompt_tokens is not None:
        record.prompt_tokens = int(info.prompt_tokens)


async def sse_lines(resp: "httpx.Response") -> AsyncIterator[bytes]:
    """The stream's lines as bytes, split on the raw body: httpx's `aiter_lines` stacks a text
    decoder and a line decoder on top, a cost per event that the client pays on the cores it
    shares with the server under test (an event's JSON is ASCII or UTF-8 either way)."""
    pending: list[bytes] = []  # the unfinished line's pieces: a long line costs its length once, not per chunk
    async for data in resp.aiter_bytes():
        *lines, tail = data.split(b"\n")
        if lines:
            lines[0] = b"".join(pending) + lines[0]
            pending.clear()
            for line in lines:
                yield line.rstrip(b"\r")
        if tail:
            pending.append(tail)
    if pending:
        yield b"".join(pending).rstrip(b"\r")


async def send_request(client: "httpx.AsyncClient", url: str, payload: dict[str, Any],
                       headers: dict[str, str] | None = None) -> RequestRecord:
    """POST one streaming request and time its chunks; errors are recorded, never raised."""
    record = RequestRecord(time.perf_counter(), int(payload["max_tokens"]),
                           len(payload["prompt"]) if isinstance(payload["prompt"], list) else 0)
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {resp.status_code}: {body[:300]}"
                return record
            async for line in sse_lines(resp):
                if not line.startswith(b"data:"):
                    continue
                now = time.perf_counter()
                info = parse_event(line[len(b"data:"):].decode("utf-8", "replace"))
                if info.done:
                    break
                apply_chunk(record, info, now)
                if record.error is not None:
                    break
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    if record.error is None and not record.chunk_times:
        record.error = "the stream ended without any generated token"
    return record


async def first_model(client: "httpx.AsyncClient", base_url: str, headers: dict[str, str] | None = None) -> str:
    """The server's first listed model, for when --model is not given."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = await client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
    if resp.status_code != 200:
        raise ValueError(f"{url}: HTTP {resp.status_code}: {resp.text[:300]} (wrong --api-key?)")
    models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])
