"""A request's own edits of its logits before sampling: what it may not say, and what it prefers.

These are vLLM's `SamplingParams` fields of the same names (logit_bias is also OpenAI's):
- `allowed_token_ids`: every other token is set to -inf;
- `bad_words`: the last token of a banned word is set to -inf once the output ends with the
  word's other tokens (a one-token word always), so the word never appears whole;
- `min_tokens`: EOS and the stop token ids are set to -inf until that many tokens are out;
- `logit_bias`: added to the given tokens' logits.

`LogitsEdits.build` turns one step's rows into a few index tensors, only for the rows that ask,
and `apply` makes one pass per kind of edit. They run after the structured-output bitmask and
before the penalties (`sampler.apply_logits_processors`), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvflow.sampling.params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class LogitsEdits:
    """One step's edits, as index tensors into its [N, V] logits; None where no row has that kind."""

    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [A], token ids [A, V] bool mask)
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) set to -inf
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, added values)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        eos_token_ids: list[int],
        vocab_size: int,
        bad_words_token_ids: list[list[list[int]]] | None = None,
        device: torch.device | str = "cpu",
    ) -> "LogitsEdits | None":
        """The edits of these rows (row i: params[i], output_token_ids[i], bad_words_token_ids[i]).

        None when no row has any, so a step of plain requests builds nothing.
        """
        # One pass finds the rows with anything to do: at a plain step, that is all this costs.
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        allowed_rows, bias_rows = [], []
        for i, p in enumerate(params):
            due = p.min_tokens > len(output_token_ids[i])
            words = bad_words_token_ids[i] if bad_words_token_ids is not None else None
            if due or words:
                banned = _bad_word_bans(words, output_token_ids[i]) if words else set()
                if due:
                    banned.update(p.stop_token_ids)
                    if not p.ignore_eos:
                        banned.update(eos_token_ids)
                for t in sorted(banned):
                    if 0 <= t < vocab_size:
                        ban_rows.append(i)
                        ban_cols.append(t)
            if p.allowed_token_ids is not None:
                allowed_rows.append(i)
            if p.logit_bias:
                bias_rows.append(i)
        if not (ban_rows or allowed_rows or bias_rows):
            return None
        edits = cls()
        if ban_rows:
            edits.banned = (_long(ban_rows, device), _long(ban_cols, device))
        if allowed_rows:
            mask = torch.zeros(len(allowed_rows), vocab_size, dtype=torch.bool, device=device)
            for j, i in enumerate(allowed_rows):
                ids = [t for t in params[i].allowed_token_ids if t < vocab_size]
                mask[j, _long(ids, device)] = True
            edits.allowed = (_long(allowed_rows, device), mask)
        bias = [(i, t, b) for i in bias_rows for t, b in sorted(params[i].logit_bias.items()) if t < vocab_size]
        if bias:
            rows, cols, values = zip(*bias)
            edits.bias = (_long(rows, device), _long(cols, device),
                          torch.tensor(values, dtype=torch.float32, device=device))
        return edits if edits.allowed is not None or edits.banned is not None or edits.bias is not None else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The edited logits (float32, [N, V]); the input is left as it was."""
        if self.allowed is not None:
            rows, mask = self.allowed
            logits = logits.index_put((rows,), logits[rows].masked_fill(~mask, _NEG_INF))
        if self.banned is not None:
            logits = logits.index_put(self.banned, torch.tensor(_NEG_INF, device=logits.device))
        if self.bias is not None:
            rows, cols, values = self.bias
            logits = logits.index_put((rows, cols), values, accumulate=True)
        return logits


def _long(values: Any, device: torch.device | str) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long, device=device)


def _bad_word_bans(words: list[list[int]], output: list[int]) -> set[int]:
    """The tokens that would complete a bad word now: each word's last token where the output
    ends with the word's other tokens (always, for a word of one token)."""
    banned = set()
    for word in words:
        head = word[:-1]
        if len(head) <= len(output) and (not head or output[len(output) - len(head):] == head):
            banned.add(word[-1])
    return banned


def bad_words_token_ids(tokenizer: Any, words: list[str] | None) -> list[list[int]]:
    """Each bad word's token ids as the model would write it: as given (the start of the text)
    and after a space (inside it), both forms banned; duplicates dropped.

    The forms are tokenized alone, so a tokenizer that merges a word with what comes before it
    in some other way (no space, a different prefix) can still spell it: bad_words bans the
    usual spellings, as vLLM's does, not every byte sequence that renders the word.
    """
    if not words:
        return []
    if tokenizer is None:
        raise ValueError("bad_words: this model has no tokenizer to spell the words with; "
                         "ban token ids with logit_bias instead")
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out
