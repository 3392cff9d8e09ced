"""N-gram prompt lookup: guess the next tokens by finding the context's tail earlier in it.

For n from `max_n` down to `min_n`, the last n tokens of prompt + output are searched for
in the tokens before them; at the latest earlier occurrence, the tokens that followed it
are the proposal. The latest, not the first: when the output copies a passage with an edit
(a renamed variable), the copy made so far predicts the rest better than the original.
Costs microseconds of numpy per sequence and needs no model, so a miss is nearly free.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int] | np.ndarray, num_tokens: int) -> list[int]:
        """Up to `num_tokens` guesses of what follows `token_ids`; [] when no n-gram matches."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if num_tokens < 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = _latest_match(tokens, n)
            if start is not None:
                follow = start + n
                return tokens[follow : follow + num_tokens].tolist()
        return []


def _latest_match(tokens: np.ndarray, n: int) -> int | None:
    """Start of the latest occurrence of the last n tokens that ends before the last token."""
    length = len(tokens)
    pattern = tokens[length - n :]
    # Candidate starts i in [0, length - n - 1]: the occurrence tokens[i:i+n] ends before the
    # final position, so at least one token follows it.
    candidates = np.flatnonzero(tokens[: length - n] == pattern[0])
    for offset in range(1, n):
        if candidates.size == 0:
            return None
        candidates = candidates[tokens[candidates + offset] == pattern[offset]]
    return int(candidates[-1]) if candidates.size else None
