"""Beam search, with vLLM's names and scoring: the `beam_width` best continuations of a prompt.

Each step extends every live beam by one token: one engine request per beam, `max_tokens=1`
with the top `2 * beam_width` logprobs, so the engine batches all beams (of all prompts) into
one step and its prefix cache serves each beam's earlier blocks, which beams share (a step
recomputes at most a partial block per beam). From the candidates, those ending in EOS are
set aside as finished; the best `beam_width` others, by score, are the next step's beams.
After `max_tokens` steps (or when no beam is left) the finished and live beams are ranked
together and the best `beam_width` returned.

The score is vLLM's: the cumulative logprob divided by the sequence length (prompt included,
a final EOS not counted) to the power `length_penalty`. The logprobs are the raw model's
(log-softmax of the float32 logits), as every kvflow logprob is.

`BeamSearch` is one prompt's state; `LLM.beam_search` and the server's `use_beam_search` only
run each step's requests (`pending_beams`) and hand back their logprobs (`advance_all`), so the
search itself is written once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

from kvflow.outputs import Logprob
from kvflow.sampling.detokenizer import decode_token, name_tokens
from kvflow.sampling.params import MAX_LOGPROBS, SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        limit = MAX_LOGPROBS // 2  # each step asks for 2 x beam_width logprobs
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= limit:
            raise ValueError(f"beam_width must be an int in [1, {limit}], got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (the prompt's first), the logprobs of each step and their sum."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # each step's, named when returned
    cum_logprob: float = 0.0
    text: str | None = None  # set when returned
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None  # the EOS token id that ended it
    lora_request: Any = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # the best beam_width, best first


def beam_score(seq: BeamSearchSequence, eos_token_ids: list[int], length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty, with IEEE's limits where the power leaves float range
    (a length_penalty of 400 or -400): Python's float power raises instead."""
    length = len(seq.tokens) - (1 if seq.tokens and seq.tokens[-1] in eos_token_ids else 0)
    try:
        denominator = length ** length_penalty
    except OverflowError:
        denominator = math.inf
    if denominator == 0.0:
        return -math.inf if seq.cum_logprob < 0 else 0.0
    return seq.cum_logprob / denominator


class BeamSearch:
    """One prompt's search (see the module docstring)."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: list[int],
                 max_model_len: int, lora_request: Any = None) -> None:
        self.params, self.eos_token_ids, self.max_model_len = params, eos_token_ids, max_model_len
        self.num_prompt_tokens = len(prompt_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_token_ids), lora_request=lora_request)]
        self.completed: list[BeamSearchSequence] = []
        self.num_steps = 0

    @property
    def done(self) -> bool:
        return not self.beams

    def step_params(self) -> SamplingParams:
        """What each beam's one-token request asks of the engine."""
        p = self.params
        return SamplingParams(max_tokens=1, temperature=p.temperature, logprobs=2 * p.beam_width, ignore_eos=True,
                              detokenize=False)

    def _score(self, seq: BeamSearchSequence) -> float:
        return beam_score(seq, self.eos_token_ids, self.params.length_penalty)

    def advance(self, step_logprobs: list[dict[int, Logprob]]) -> None:
        """Extend the beams by this step's logprobs (one {token_id: Logprob} per beam, in order)."""
        if len(step_logprobs) != len(self.beams):
            raise ValueError(f"beam search: {len(step_logprobs)} results for {len(self.beams)} beams")
        candidates = []
        for beam, logprobs in zip(self.beams, step_logprobs):
            for token_id, logprob in logprobs.items():
                new = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [logprobs],
                                         beam.cum_logprob + logprob.logprob, lora_request=beam.lora_request)
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", token_id
                    self.completed.append(new)
                else:
                    candidates.append(new)
        candidates.sort(key=self._score, reverse=True)
        self.beams = candidates[: self.params.beam_width]
        self.num_steps += 1
        if self.num_steps >= self.params.max_tokens or any(len(b.tokens) >= self.max_model_len for b in self.beams):
            for beam in self.beams:
                beam.finish_reason = "length"
            self.completed.extend(self.beams)
            self.beams = []

    def result(self, tokenizer: Any) -> BeamSearchOutput:
        """The best beam_width sequences, best first, with their text (EOS's own text only when
        include_stop_str_in_output) and their logprobs' tokens named (the steps ran without text;
        beams that share a parent share its entries, named alike)."""
        best = sorted(self.completed + self.beams, key=self._score, reverse=True)[: self.params.beam_width]
        for seq in best:
            generated = seq.tokens[self.num_prompt_tokens:]
            if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                generated = generated[:-1]
            seq.text = tokenizer.decode(generated, skip_special_tokens=False) if tokenizer is not None else None
            if tokenizer is not None:
                name_tokens(seq.logprobs, functools.partial(decode_token, tokenizer))
        return BeamSearchOutput(best)


def pending_beams(searches: list[BeamSearch]) -> list[tuple[BeamSearch, BeamSearchSequence]]:
    """Every live beam of every unfinished search, in order: this step's one-token requests."""
    return [(search, beam) for search in searches if not search.done for beam in search.beams]


def advance_all(pending: list[tuple[BeamSearch, BeamSearchSequence]],
                step_logprobs: list[dict[int, Logprob]]) -> None:
    """Hand each search its beams' results (`step_logprobs` in `pending`'s order). The drivers
    (`LLM.beam_search`, the server's) only run the requests in between."""
    if len(step_logprobs) != len(pending):
        raise ValueError(f"beam search: {len(step_logprobs)} results for {len(pending)} beams")
    grouped: dict[int, tuple[BeamSearch, list[dict[int, Logprob]]]] = {}
    for (search, _), logprobs in zip(pending, step_logprobs):
        grouped.setdefault(id(search), (search, []))[1].append(logprobs)
    for search, results in grouped.values():
        search.advance(results)
