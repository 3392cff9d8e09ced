"""A request's prompt as token ids, the same for every route (completions, chat, embeddings,
/tokenize, beam search) and as `LLM.generate` makes them.

Routes call these through asyncio.to_thread: the tokenizer lets go of the GIL, so a long
prompt's tokenization does not stall every other stream and /health.
"""

from __future__ import annotations

from typing import Any

from kvflow.engine.inputs import check_chat_options, render_chat
from kvflow.entrypoints.openai import protocol as p
from kvflow.entrypoints.openai.errors import check_text

# A text longer than this many characters per token of context is counted on its head first
# (English runs about 4 characters a token); the margin covers the tokens a cut can split or merge.
HEAD_CHARS_PER_TOKEN, HEAD_MARGIN_TOKENS = 16, 64


def encode(tok: Any, text: str, param: str, max_model_len: int, bounded: bool,
           add_special_tokens: bool = True) -> list[int]:
    """The text's ids. `bounded` (a prompt that must fit the context): a text of more than
    HEAD_CHARS_PER_TOKEN characters per token of context is first counted on its head, cut at a
    space, where its tokens are the whole text's first ones; a head already past the context is
    refused then, so a multi-megabyte prompt costs a fraction of a second, not the 79 s that
    tokenizing 24 MiB took before its 400."""
    head = HEAD_CHARS_PER_TOKEN * max_model_len
    if bounded and len(text) > head:
        cut = text.rfind(" ", head // 2, head)
        cut = head if cut < 0 else cut
        count = len(tok(text[:cut], add_special_tokens=add_special_tokens).input_ids)
        if count > max_model_len + HEAD_MARGIN_TOKENS:
            raise p.InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens, but the prompt is longer: its "
                f"first {cut:,} characters alone are {count:,} tokens.", param=param, code="context_length_exceeded")
    return tok(text, add_special_tokens=add_special_tokens).input_ids


def chat_text(tok: Any, body: p.ChatCompletionRequest) -> str:
    """The chat template's text for the request's messages, or a 400 naming `messages`."""
    if tok is None or not getattr(tok, "chat_template", None):
        raise p.InvalidRequestError("messages: this model has no chat template; use /v1/completions",
                                    param="messages")
    conversation = [m.to_template_dict() for m in body.messages]
    check_chat_options(body.add_generation_prompt, body.continue_final_message)  # a 400 naming that field
    try:
        text = render_chat(tok, conversation, add_generation_prompt=body.add_generation_prompt,
                           continue_final_message=body.continue_final_message, tools=body.template_tools(),
                           chat_template_kwargs=body.chat_template_kwargs)
    except Exception as exc:  # a template that rejects the conversation (roles out of order, ...)
        raise p.InvalidRequestError(f"messages: the chat template rejected the conversation: {exc}",
                                    param="messages") from exc
    check_text(text, "messages")
    return text
