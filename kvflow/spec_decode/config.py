"""`speculative_config`: which proposer guesses tokens, how many, and when speculation is off.

Shaped like vLLM's dict, so `LLM(speculative_config={...})` and
`kvflow serve --speculative-config '{...}'` accept the same keys:

  {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
  {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}

Every key is checked here, once, so a bad config fails at start-up with a message that
names the field instead of deep inside a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow.config import config_object, is_int

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # n-gram prompt lookup: the longest suffix of the context, between these lengths, that
    # occurred earlier in the prompt or output proposes the tokens that followed it there.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # draft_model: a smaller model with the target's vocabulary (HF directory or GGUF file).
    model: str | None = None
    # The draft's weight quantization (int8, int4, gguf, none; kvflow.quantization): with
    # `model` set to the target's own path, "int4" is the quantized self-draft.
    quantization: str | None = None
    # With `quantization`, the draft's LM head is quantized too unless this says no: a draft's
    # guesses are checked by the target, and in a 135M model the head is a fifth of the bytes
    # a step streams.
    quantize_lm_head: bool = True
    # Speculation is off for every sequence while more than this many requests are
    # unfinished: a full batch is compute-bound and verifying guesses only slows it down.
    disable_by_batch_size: int | None = 4
    # A sequence whose recent speculative steps accepted fewer than this many tokens per
    # step on average stops proposing for a while (see Speculator).
    min_mean_accepted: float = 0.3

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """From a dict, a JSON string (the CLI's form) or an existing config; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = config_object(value, "speculative_config", cls)
        if value.get("method") not in METHODS:
            what = "required" if "method" not in value else f"{value['method']!r} is not"
            raise ValueError(f"speculative_config.method: {what} one of {', '.join(METHODS)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens: required (tokens proposed per step, >= 1)")
        return cls(**value)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: {self.method!r} is not one of {', '.join(METHODS)}")
        if not is_int(self.num_speculative_tokens) or self.num_speculative_tokens < 1:
            raise ValueError(
                f"speculative_config.num_speculative_tokens: must be an integer >= 1, got {self.num_speculative_tokens!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"speculative_config.{name}: must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None and (
                not is_int(self.disable_by_batch_size) or self.disable_by_batch_size < 1):
            raise ValueError("speculative_config.disable_by_batch_size: must be an integer >= 1 or null, "
                             f"got {self.disable_by_batch_size!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            if getattr(self, name) is not None:  # numpy's ints overflow, and JSON refuses them (as EngineConfig)
                object.__setattr__(self, name, int(getattr(self, name)))
        if not isinstance(self.min_mean_accepted, (int, float)) or not 0 <= self.min_mean_accepted <= self.num_speculative_tokens:
            raise ValueError(f"speculative_config.min_mean_accepted: must be in [0, num_speculative_tokens], "
                             f"got {self.min_mean_accepted!r}")
        if self.method == "draft_model":
            if not self.model:
                raise ValueError("speculative_config.model: required for method 'draft_model' (an HF directory or GGUF file)")
        elif self.model is not None or self.quantization is not None:
            raise ValueError(f"speculative_config.model: only method 'draft_model' takes a model, not {self.method!r}")
        if not isinstance(self.quantize_lm_head, bool):
            raise ValueError(f"speculative_config.quantize_lm_head: must be true or false, got {self.quantize_lm_head!r}")
        if self.quantization is not None:
            from kvflow.quantization.config import QuantizationConfig

            try:
                QuantizationConfig.parse(self.quantization)
            except ValueError as e:
                raise ValueError(f"speculative_config.{e}") from None

    def describe(self) -> str:
        if self.method == "ngram":
            what = f"ngram prompt lookup, {self.prompt_lookup_min}..{self.prompt_lookup_max}-grams"
        else:
            head = ", LM head too" if self.quantize_lm_head else ""
            what = f"draft model {self.model}" + (f" ({self.quantization}{head})" if self.quantization else "")
        batch = "never" if self.disable_by_batch_size is None else f"above {self.disable_by_batch_size} unfinished requests"
        return (f"speculative decoding: {what}, {self.num_speculative_tokens} tokens per step; off {batch}, "
                f"and for a sequence accepting under {self.min_mean_accepted} tokens per step")
