"""Pearson's chi-square tests, with p-values from torch (no scipy in the test set-up)."""

from __future__ import annotations

import torch


def _p_value(statistic: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def goodness_of_fit(counts: list[int], probs: list[float], min_expected: float = 5.0) -> float:
    """p-value of observed counts against a known distribution; sparse cells are pooled."""
    total = sum(counts)
    expected = [p * total for p in probs]
    assert all(c == 0 for c, e in zip(counts, expected) if e == 0), "a count fell where the law has no mass"
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for c, e in zip(counts, expected):
        if e >= min_expected:
            cells.append((c, e))
        elif e > 0:
            pooled_obs, pooled_exp = pooled_obs + c, pooled_exp + e
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    statistic = sum((c - e) ** 2 / e for c, e in cells)
    return _p_value(statistic, len(cells) - 1)


def homogeneity(a: dict, b: dict, min_expected: float = 5.0) -> float:
    """p-value that two samples of categories (dicts of counts) come from one distribution."""
    na, nb = sum(a.values()), sum(b.values())
    rows, rare_a, rare_b = [], 0, 0
    for key in set(a) | set(b):
        ca, cb = a.get(key, 0), b.get(key, 0)
        if (ca + cb) * min(na, nb) / (na + nb) >= min_expected:
            rows.append((ca, cb))
        else:
            rare_a, rare_b = rare_a + ca, rare_b + cb
    if rare_a + rare_b:
        rows.append((rare_a, rare_b))
    statistic = 0.0
    for ca, cb in rows:
        total = ca + cb
        for observed, n in ((ca, na), (cb, nb)):
            expected = total * n / (na + nb)
            statistic += (observed - expected) ** 2 / expected
    return _p_value(statistic, len(rows) - 1)
