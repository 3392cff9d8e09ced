"""What a request's prompt may be, and how it becomes token ids.

A prompt is a string (tokenized here), a list of token ids, or a dict with "prompt_token_ids"
(and optionally the "prompt" text they came from) or "prompt": the forms vLLM's `generate`
takes. A model directory without tokenizer files still serves token-id prompts.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvflow.config import is_int
from kvflow.sampling.params import check_truncate_prompt_tokens

logger = logging.getLogger("kvflow")

PromptInput = str | list[int] | dict[str, Any]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer_or_none(path: str) -> Any:
    """The model's tokenizer, or None for a bare directory (then prompts must be token ids)."""
    if os.path.isfile(path) and os.path.basename(path) == "config.json":
        path = os.path.dirname(path)
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files: prompts must be given as token ids", path)
        return None
    from kvflow.loader.tokenizer import load_tokenizer

    return load_tokenizer(path)


PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")  # what a dict prompt may hold (vLLM's names)
_MULTIMODAL_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "prompt_embeds")


def check_prompt_keys(prompt: dict) -> None:
    """Refuse keys kvflow would otherwise ignore: an image in `multi_modal_data` dropped without a
    word leaves a text-only model describing a picture it never saw."""
    unknown = [k for k, v in prompt.items() if k not in PROMPT_KEYS and v is not None]  # None: nothing to drop
    if not unknown:
        return
    if any(k in _MULTIMODAL_KEYS for k in unknown):
        raise ValueError(f"prompt: {', '.join(unknown)}: kvflow serves text-only models (no images, audio or "
                         "prompt embeddings); send text or token ids")
    raise ValueError(f"prompt: unknown key(s) {', '.join(map(repr, unknown))}; a dict prompt takes "
                     f"{', '.join(PROMPT_KEYS)}")


def tokenize_prompt(tokenizer: Any, prompt: PromptInput) -> tuple[str | None, list[int]]:
    """(the prompt's text if known, its token ids)."""
    if isinstance(prompt, dict):
        check_prompt_keys(prompt)
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), token_id_list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass {'prompt_token_ids': [...]}")
        check_unicode(prompt, "prompt")
        return prompt, tokenizer(prompt).input_ids
    if isinstance(prompt, list):
        return None, token_id_list(prompt)
    raise ValueError(f"prompt: expected a string, a list of token ids or a dict, got {type(prompt).__name__}")


def check_unicode(text: str, field: str) -> None:
    """Refuse text that is not valid Unicode, such as a lone surrogate (JSON's \\ud800 escape, or a
    Python string sliced mid-pair): no tokenizer can encode it, so the error names the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field}: the text is not valid Unicode ({exc.reason} at character {exc.start})") from None


def token_id_list(ids: Any) -> list[int]:
    """Token ids as a list of ints, from a list, tuple, numpy array or tensor of integers: a float
    or a bool is refused, not truncated (1.9 is not token 1)."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"prompt: prompt_token_ids must be a list of integers, got {type(ids).__name__}")
    values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    for t in values:
        if not is_int(t):
            raise ValueError(f"prompt: token ids must be integers, got {t!r}")
    return [int(t) for t in values]


def cache_salt_of(prompt: PromptInput) -> str | None:
    """vLLM's `cache_salt` prompt key: a non-empty string, or None."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt: must be a non-empty string")
    return salt


def check_prompt_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """Refuse prompt ids the model's embedding does not have (before anything reads them)."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        raise ValueError(f"prompt: token ids must be in [0, {vocab_size}), got {min(token_ids)}..{max(token_ids)}")


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int, generates: bool = True) -> None:
    """Refuse an empty prompt, ids outside the vocabulary, and a prompt too long for the model
    (with room for one generated token, unless the request only embeds its prompt)."""
    if not token_ids:
        raise ValueError("prompt: the prompt is empty; give at least one token")
    check_prompt_token_ids(token_ids, vocab_size)
    if len(token_ids) > max_model_len - generates:
        room = " (prompt plus at least one generated token must fit)" if generates else ""
        raise ValueError(f"prompt: the prompt is {len(token_ids)} tokens, but max_model_len is {max_model_len}{room}")


def truncate_prompt(text: str | None, token_ids: list[int], keep: int | None,
                    max_model_len: int) -> tuple[str | None, list[int]]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: the last max_model_len).
    A cut prompt has no text of its own (its ids are what the model sees)."""
    if keep is None:
        return text, token_ids
    check_truncate_prompt_tokens(keep)
    keep = max_model_len if keep == -1 else keep
    return (text, token_ids) if len(token_ids) <= keep else (None, token_ids[-keep:])


def check_chat_options(add_generation_prompt: bool, continue_final_message: bool) -> None:
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: continuing the last message and adding a new assistant turn "
                         "exclude each other; set add_generation_prompt to false")


def render_chat(tokenizer: Any, conversation: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The chat template's text for a conversation, as vLLM renders it (`LLM.chat` and the chat route):
    chat_template_kwargs may carry the template's own options too, and win; `tokenize` stays False."""
    check_chat_options(add_generation_prompt, continue_final_message)
    options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
               "tools": tools, "chat_template": chat_template, **(chat_template_kwargs or {})}
    return tokenizer.apply_chat_template(conversation, tokenize=False, **options)
