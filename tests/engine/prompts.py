"""Prompt sets shared by the engine tests and tests/data/make_reference.py."""

from __future__ import annotations

import numpy as np

OWN_TOKENS = 32
INVARIANCE_TOKENS = 16

OWN_PROMPTS = [
    "The quick brown fox",
    "In 1969, the first humans",
    "import numpy as np\n\ndef softmax(x):",
    "Q: What is 17 times 23?\nA:",
    "Les montagnes de France sont",
    "1, 1, 2, 3, 5, 8, 13,",
    "A recipe for pancakes:\n1.",
    "<html>\n  <head>\n    <title>",
    "The mitochondria is",
    "Dear hiring manager, I am writing to",
    "SELECT name, COUNT(*) FROM users",
]


def invariance_prompts() -> list[list[int]]:
    """32 mixed-length prompts, then two of over 1,000 tokens (forced into chunks by small budgets)."""
    rng = np.random.default_rng(42)
    lengths = list(rng.integers(3, 300, 32)) + [1030, 1200]
    return [rng.integers(1000, 40000, int(n)).tolist() for n in lengths]
