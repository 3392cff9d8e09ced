"""N-gram prompt lookup proposes what followed the context's tail where it last occurred."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from kvflow.spec_decode.ngram_proposer import NgramProposer


def test_longest_ngram_wins_and_latest_occurrence_is_used():
    p = NgramProposer(min_n=1, max_n=3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    # "5 6" occurs at 0 and 4; the latest (4) is followed by 8 2 5 6.
    assert p.propose(tokens, 3) == [8, 2, 5]
    # A 3-gram "2 5 6" has no earlier occurrence, so the 2-gram decides.
    assert NgramProposer(min_n=3, max_n=3).propose(tokens, 3) == []


def test_proposal_is_capped_by_what_follows_and_by_k():
    p = NgramProposer(min_n=1, max_n=2)
    assert p.propose([9, 4, 3, 9], 5) == [4, 3, 9]
    assert p.propose([9, 4, 3, 9], 2) == [4, 3]
    assert p.propose([9, 4, 3, 9], 0) == []
    assert p.propose([9], 3) == []
    assert p.propose([1, 2, 3, 4], 3) == []


def test_min_n_refuses_short_matches():
    tokens = [1, 2, 3, 4, 1]
    assert NgramProposer(min_n=1, max_n=4).propose(tokens, 2) == [2, 3]
    assert NgramProposer(min_n=2, max_n=4).propose(tokens, 2) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 3), st.integers(0, 2), st.integers(1, 6))
def test_matches_a_brute_force_search(tokens, min_n, extra, k):
    max_n = min_n + extra
    got = NgramProposer(min_n, max_n).propose(tokens, k)
    expected: list[int] = []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tail]
        if starts:
            expected = tokens[starts[-1] + n : starts[-1] + n + k]
            break
    assert got == expected
    assert np.all(np.asarray(got) >= 0)
