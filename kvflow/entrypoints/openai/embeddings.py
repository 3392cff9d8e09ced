"""OpenAI's /v1/embeddings: one vector per input, from the engine's pooler (kvflow/pooling).

`input` is what OpenAI takes (a string, a list of strings, a token-id list or a list of
those); vLLM's chat form sends `messages` instead and embeds the chat template's text. Each
input is one engine request, batched with whatever else is running; all are submitted or none.
`encoding_format: "base64"` (the OpenAI Python client's default) packs each vector as
little-endian float32 bytes. `dimensions` cuts a Matryoshka model's vector (others refuse it).
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from kvflow.entrypoints.openai import choices as c
from kvflow.entrypoints.openai import protocol as p
from kvflow.engine.inputs import truncate_prompt
from kvflow.entrypoints.openai.errors import check_text
from kvflow.entrypoints.openai.tool_calls import ToolFields
from kvflow.outputs import PoolingRequestOutput
from kvflow.pooling.params import PoolingParams

if TYPE_CHECKING:
    from kvflow.entrypoints.openai.server import OpenAIServer

MAX_INPUTS = 2048  # OpenAI's own limit on inputs per request


class EmbeddingRequest(p.OpenAIModel, ToolFields):
    """Exactly one of `input` (OpenAI's) and `messages` (vLLM's chat form, with its template options)."""

    model: str | None = None
    input: str | list[str] | list[p.TokenId] | list[list[p.TokenId]] | None = None
    messages: list[p.ChatMessage] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras
    normalize: bool | None = None  # None: the server's --pooler-config
    truncate_prompt_tokens: int | None = None  # keep the last k tokens of each input (-1: max_model_len)
    add_special_tokens: bool | None = None  # None: True for `input`, False for `messages` (the template writes them)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0
    cache_salt: Annotated[str, Field(min_length=1)] | None = None


class EmbeddingData(p.OpenAIModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(p.OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: p.UsageInfo


def register_embeddings(app: FastAPI, server: "OpenAIServer") -> None:
    """Add POST /v1/embeddings to `app`, answered by `server`'s engine."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        lora, model = server.check_model(body.model), server.models.response_name(body.model)
        prompts = await asyncio.to_thread(_prompts, server, body)
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
        _, streams = await c.submit_all(server.engine, "embd", prompts, [params] * len(prompts), body, lora)
        outs: list[PoolingRequestOutput] = await c.gather_all(
            [server.final_output(stream, raw) for stream in streams], streams)
        data = [EmbeddingData(index=i, embedding=_encode(out.outputs.data.numpy(), body.encoding_format))
                for i, out in enumerate(outs)]
        usage = p.UsageInfo.of(sum(len(ids) for _, ids in prompts), 0, sum(o.num_cached_tokens for o in outs))
        resp = EmbeddingResponse(id=f"embd-{uuid.uuid4().hex}", created=int(time.time()), model=model, data=data,
                                 usage=usage)
        return Response(resp.model_dump_json(), media_type="application/json")


def _prompts(server: "OpenAIServer", body: EmbeddingRequest) -> list[tuple[str | None, list[int]]]:
    if (body.input is None) == (body.messages is None):
        raise p.InvalidRequestError("give either `input` or `messages`, not both or neither", param="input")
    tok = server.engine.tokenizer
    if body.messages is not None:
        if not body.messages:
            raise p.InvalidRequestError("messages: the conversation is empty", param="messages")
        return [server.chat_prompt(body, add_special_tokens=bool(body.add_special_tokens))]  # then cut
    one = isinstance(body.input, str) or (body.input and isinstance(body.input[0], int))
    inputs: list[str | list[int]] = [body.input] if one else list(body.input)
    if not inputs:
        raise p.InvalidRequestError("input: the list of inputs is empty", param="input")
    if len(inputs) > MAX_INPUTS:
        raise p.InvalidRequestError(f"input: {len(inputs)} inputs in one request; at most {MAX_INPUTS}",
                                    param="input")
    prompts, keep, limit = [], body.truncate_prompt_tokens, server.engine.max_model_len
    for item in inputs:
        if isinstance(item, str) and body.add_special_tokens is False and tok is not None:
            check_text(item, "input")
            ids = server.encode(item, "input", keep is None, add_special_tokens=False)
            prompts.append(truncate_prompt(item, ids, keep, limit))
        else:
            prompts.append(server.tokenize_prompt(item, keep))
    for _, ids in prompts:
        if not ids:
            raise p.InvalidRequestError("input: an input is empty; give at least one token", param="input")
    return prompts


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
