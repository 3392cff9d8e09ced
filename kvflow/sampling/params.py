"""Per-request sampling parameters, with vLLM's names and defaults.

The engine, the OpenAI-compatible server and the offline `LLM` class all accept the same
`SamplingParams`, so a script written for vLLM runs unchanged. Every field is checked once
here, at request admission, so that the sampler and the detokenizer can trust their inputs
and a bad request fails with a message that names the offending parameter instead of an
opaque tensor error deep inside a batched step.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields
from numbers import Real
from typing import Any, Mapping

from kvflow.config import INT64_MAX, SEED_MAX, SEED_MIN, is_int  # beyond them a seed fails in the engine, not at admission
from kvflow.structured_output.params import StructuredOutputsParams

# Temperatures below this are treated as greedy: dividing logits by them overflows float32
# (or makes the softmax a one-hot in all but name), so argmax is both safer and what the
# user meant.
_GREEDY_EPS = 1e-5
# The OpenAI API caps top logprobs at 20; vLLM does the same by default.
MAX_LOGPROBS = 20
# Parallel samples per request: OpenAI's own limit for `n`. Each sample is a sequence of its own
# (a KV tail, a scheduler slot), so an absurd n is refused here rather than queued; the engine
# also refuses an n above its max_num_seqs, since the samples could never all run at once.
MAX_N = 128



def _is_number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(float(value))


def check_truncate_prompt_tokens(value: object) -> None:
    if value is not None and (not is_int(value) or not (1 <= value <= INT64_MAX or value == -1)):
        raise ValueError(f"truncate_prompt_tokens must be a positive int or -1 (max_model_len), got {value!r}")


@dataclass(repr=False)
class SamplingParams:
    """How to pick the next tokens of one request and when to stop.

    Defaults follow vLLM: a plain `SamplingParams()` samples at temperature 1 for at most 16
    tokens. `top_k=-1` (vLLM's old spelling of "disabled") is normalised to 0, `stop` to a
    list of strings and `stop_token_ids` to a list, so downstream code sees one form only.

    Unset versus explicit: every instance records in `explicit_fields` the fields its
    caller named, as a constructor argument (positional or keyword) or by assigning the
    attribute later. `SamplingParams(max_tokens=32).temperature` still reads 1.0, but
    `with_defaults({"temperature": 0.2})` replaces it, because the caller never chose it;
    `SamplingParams(temperature=1.0)` keeps 1.0. This is how `LLM` and the CLI apply a
    model's own sampling defaults (generation_config.json) under an explicit request.
    `dataclasses.replace` passes every field, so its result counts all of them as explicit.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = field(default=None)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Log-probabilities of the prompt's own tokens (plus the top-k at each position), as vLLM's
    # prompt_logprobs; last, so that positional construction keeps its meaning.
    prompt_logprobs: int | None = None
    # Constrain the output to a JSON schema, regex, choice list or grammar (vLLM's field).
    structured_outputs: StructuredOutputsParams | None = None
    # False: the engine makes token ids only, no text (vLLM's field). The split server's engine core
    # runs so: its API process detokenizes and matches the stop strings (entrypoints/core/assembler.py).
    detokenize: bool = True
    # The request's own logit edits, vLLM's fields (logit_bias is also OpenAI's), applied by
    # sampling/logits_processors.py. logit_bias: token id -> bias in [-100, 100] added to its
    # logit (JSON's string keys are taken too); allowed_token_ids: only these may be sampled;
    # bad_words: words the output may not contain (the engine spells each with and without a
    # leading space and bans a word's last token once the output ends with its other tokens).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len); the engine cuts
    # the prompt at admission (engine/inputs.py truncate_prompt), the server before it checks the length.
    truncate_prompt_tokens: int | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "SamplingParams":
        # __new__ sees the constructor's own arguments, which the generated __init__ does not keep.
        # (copy and pickle call __new__ without arguments and then restore `_explicit` themselves.)
        self = super().__new__(cls)
        named = {f.name for f in fields(cls)[: len(args)]} | set(kwargs)
        if named:
            object.__setattr__(self, "_pending_explicit", named)
        return self

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()
        # From here on an attribute assignment marks its field explicit (see __setattr__).
        object.__setattr__(self, "_explicit", set(self.__dict__.pop("_pending_explicit", ())))

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        explicit = self.__dict__.get("_explicit")
        if explicit is not None and name in _FIELD_NAMES:
            explicit.add(name)

    def __copy__(self) -> "SamplingParams":
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        if "_explicit" in self.__dict__:  # a copy tracks its own assignments, not the original's
            new.__dict__["_explicit"] = set(self.__dict__["_explicit"])
        return new

    @property
    def explicit_fields(self) -> frozenset[str]:
        """The fields the caller set; the rest hold vLLM's defaults and yield to a model's."""
        return frozenset(self.__dict__.get("_explicit", ()))

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's `SamplingParams.clone`): changing its lists or constraint leaves this
        one alone; the fields the caller set stay explicit."""
        return copy.deepcopy(self)

    def with_defaults(self, defaults: Mapping[str, Any]) -> "SamplingParams":
        """A copy whose fields the caller did not set take `defaults` (self if nothing changes).

        The copy is validated again, and its `explicit_fields` stay the caller's: defaults
        never become explicit, so applying another layer of defaults later still works.
        """
        unknown = set(defaults) - _FIELD_NAMES
        if unknown:
            raise ValueError(f"sampling defaults: unknown field(s) {', '.join(sorted(unknown))}")
        explicit = self.explicit_fields
        updates = {k: v for k, v in defaults.items() if k not in explicit and getattr(self, k) != v}
        if not updates:
            return self
        new = copy.copy(self)
        del new.__dict__["_explicit"]  # untracked while filling in, as during __init__
        for name, value in updates.items():
            setattr(new, name, copy.copy(value))
        new.stop, new.stop_token_ids = list(new.stop), list(new.stop_token_ids)  # no lists shared with self
        new._normalise()
        new._validate()
        object.__setattr__(new, "_explicit", set(explicit))
        return new

    def _normalise(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a str, a list of str or None, got {self.stop!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of int or None, got {self.stop_token_ids!r}")
        if isinstance(self.structured_outputs, Mapping):  # {"json": ...} as the server's field spells it
            unknown = set(self.structured_outputs) - _STRUCTURED_FIELDS
            if unknown:
                raise ValueError(f"structured_outputs: unknown field(s) {', '.join(sorted(unknown))}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.logit_bias, Mapping):  # {"15339": -100} as JSON spells a token id
            self.logit_bias = {_token_id_key(k): v for k, v in self.logit_bias.items()}
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        elif isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words)

    def _validate(self) -> None:
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or not 0 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be in [0, {INT64_MAX}], or -1 to disable, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an int in [{SEED_MIN}, {SEED_MAX}] or None, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX):
            raise ValueError(f"max_tokens must be in [1, {INT64_MAX}] or None, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT64_MAX:
            raise ValueError(f"min_tokens must be in [0, {INT64_MAX}], got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.prompt_logprobs!r}"
            )
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        if not isinstance(self.detokenize, bool):
            raise ValueError(f"detokenize must be a bool, got {self.detokenize!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop: stop strings need the text, so detokenize must be True")
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {t!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams or None, "
                                 f"got {type(self.structured_outputs).__name__}")
            if self.min_tokens:  # the grammar decides where the output ends; a ban on EOS could leave no token
                raise ValueError(f"min_tokens must be 0 with structured_outputs, got {self.min_tokens}")
        self._validate_logit_edits()

    def _validate_logit_edits(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError(f"logit_bias must be a dict of token id to bias or None, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                if not is_int(token) or token < 0:
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
                if not _is_number(bias) or not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        if self.allowed_token_ids is not None:
            if self.structured_outputs is not None:  # the two masks could leave no token at all
                raise ValueError("allowed_token_ids cannot be combined with structured_outputs (nor with a forced "
                                 "tool call): the grammar decides which tokens are allowed")
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids or None, "
                                 f"got {self.allowed_token_ids!r}")
            for t in self.allowed_token_ids:
                if not is_int(t) or t < 0:
                    raise ValueError(f"allowed_token_ids must be non-negative ints, got {t!r}")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list):
                raise ValueError(f"bad_words must be a list of str or None, got {self.bad_words!r}")
            for w in self.bad_words:
                if not isinstance(w, str) or not w.strip():
                    raise ValueError(f"bad_words must be non-blank str, got {w!r}")

    def check_token_ids(self, vocab_size: int, eos_token_ids: list[int] = ()) -> None:
        """Refuse token ids the model's logits do not have (the sampler would index past them), and
        allowed_token_ids that could never meet min_tokens (all of them end the output)."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ())):
            outside = sorted({t for t in ids if t >= vocab_size})
            if outside:
                raise ValueError(f"{name} token ids must be in [0, {vocab_size}) for this model, got {outside[:5]}")
        if self.allowed_token_ids and self.min_tokens:
            ends = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))
            if set(self.allowed_token_ids) <= ends:
                raise ValueError(f"allowed_token_ids are all stop or EOS tokens, so min_tokens={self.min_tokens} "
                                 "could never be met")

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: temperature 0, or so close to it that dividing by it is unsafe."""
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler must build token-count tensors for this request."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def edits_logits(self) -> bool:
        """Whether the logits change before the argmax for reasons of this request's own (penalties,
        logit_bias, allowed_token_ids, bad_words): a greedy row then needs more than a bare argmax."""
        return (self.has_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words))

    @property
    def reads_output(self) -> bool:
        """Whether those edits depend on the tokens generated so far (penalties, bad_words)."""
        return self.has_penalties or bool(self.bad_words)

    def __repr__(self) -> str:
        """Show only what differs from the defaults, so logs stay one short line."""
        default = _DEFAULTS
        parts = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        ]
        return f"SamplingParams({', '.join(parts)})"


def _token_id_key(key: Any) -> Any:
    """A logit_bias key as a token id: JSON objects key by string, so "15339" means 15339."""
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    return key


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))
_STRUCTURED_FIELDS = frozenset(f.name for f in fields(StructuredOutputsParams))
_DEFAULTS = SamplingParams()
