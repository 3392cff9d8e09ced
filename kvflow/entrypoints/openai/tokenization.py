"""vLLM's /tokenize and /detokenize: a client counts a prompt's tokens exactly as the server will.

/tokenize takes a completion `prompt` or chat `messages` and answers with the token ids that
/v1/completions or /v1/chat/completions would give the model for them (the same chat template
and special tokens, through the same `OpenAIServer` methods), their count and max_model_len:
enough to check that a prompt fits, or to budget max_tokens, before sending it. /detokenize
turns token ids back into text. Both need the API key when the server has one, as /v1 does.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import Response

from kvflow.entrypoints.openai import protocol as p
from kvflow.entrypoints.openai.errors import check_text
from kvflow.entrypoints.openai.tool_calls import ToolFields

if TYPE_CHECKING:
    from kvflow.entrypoints.openai.server import OpenAIServer

ROUTES = ("/tokenize", "/detokenize")


class TokenizeRequest(p.OpenAIModel, ToolFields):
    """Exactly one of `prompt` (as /v1/completions takes it) and `messages` (as /v1/chat/completions,
    with its `tools` for the template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[p.ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # None: as the generating route does (a completion prompt gets the tokenizer's special
    # tokens; a chat prompt none, its template writes them).
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class TokenizeResponse(p.OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(p.OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(p.OpenAIModel):
    prompt: str


def register_tokenization(app: FastAPI, server: "OpenAIServer") -> None:
    """Add POST /tokenize and POST /detokenize to `app`, answered by `server`'s tokenizer."""

    def tokenizer() -> Any:
        tok = server.engine.tokenizer
        if tok is None:
            raise p.InvalidRequestError("this model has no tokenizer: it takes and gives token ids only")
        return tok

    def token_ids(body: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        ids = _ids(body)
        return ids, server.engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None

    def _ids(body: TokenizeRequest) -> list[int]:
        """The ids the generating route would give the model, counted whole however long (no
        context check: answering how far past it a prompt goes is this route's job)."""
        if body.messages is not None:
            if not body.messages:
                raise p.InvalidRequestError("messages: the conversation is empty", param="messages")
            return server.chat_prompt(body, add_special_tokens=bool(body.add_special_tokens), bounded=False)[1]
        if body.add_special_tokens is False:
            check_text(body.prompt, "prompt")
            return server.encode(body.prompt, "prompt", bounded=False, add_special_tokens=False)
        return server.tokenize_prompt(body.prompt, bounded=False)[1]

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        server.check_model(body.model)
        tokenizer()  # a 400 for a model without one
        if (body.prompt is None) == (body.messages is None):
            raise p.InvalidRequestError("give either `prompt` or `messages`, not both or neither", param="prompt")
        ids, strs = await asyncio.to_thread(token_ids, body)  # off the event loop, as the generating routes do
        out = TokenizeResponse(count=len(ids), max_model_len=server.engine.max_model_len, tokens=ids, token_strs=strs)
        return Response(out.model_dump_json(), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        server.check_model(body.model)
        tok = tokenizer()
        outside = sorted({t for t in body.tokens if not 0 <= t < len(tok)})
        if outside:
            raise p.InvalidRequestError(f"tokens: ids must be in [0, {len(tok)}), got {outside[:5]}", param="tokens")
        text = tok.decode(body.tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return Response(DetokenizeResponse(prompt=text).model_dump_json(), media_type="application/json")
