"""What a request's prompt may be, and how it becomes token ids.

A prompt is a string (tokenized here), a list of token ids, or a dict with "prompt_token_ids"
(and optionally the "prompt" text they came from) or "prompt": the forms vLLM's `generate`
takes. A model directory without tokenizer files still serves token-id prompts.
"""

from __future__ import annotations

import logging
import os
from typing import Any

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


def tokenize_prompt(tokenizer: Any, prompt: PromptInput) -> tuple[str | None, list[int]]:
    """(the prompt's text if known, its token ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass {'prompt_token_ids': [...]}")
        return prompt, tokenizer(prompt).input_ids
    if isinstance(prompt, list):
        return None, [int(t) for t in prompt]
    raise ValueError(f"prompt: expected a string, a list of token ids or a dict, got {type(prompt).__name__}")
