"""W-chat: short open questions in the chat template, the speculative bench's counterpart of
W-grounded. Their answers quote nothing of the prompt, so n-gram lookup finds little and a draft
model has to predict the target's own words: the workload for the issue's "chat prompts" target
of the int4 self-draft. The questions are written for kvflow (no outside text); a draw is a
permutation from `default_rng(seed)`, so a warm-up drawn with another seed and the timed set
given as `exclude` share no question.
"""

from __future__ import annotations

import numpy as np

from kvflow.bench.datasets import BenchRequest
from kvflow.bench.grounded import chat_prompt_ids

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "How do I boil an egg?",
    "Why do cats purr?",
    "Suggest a name for a small bakery.",
    "What causes the seasons on Earth?",
    "Write a short poem about autumn leaves.",
    "How does a rainbow form?",
    "What should I pack for a weekend hiking trip?",
    "How do plants make their food?",
    "What is a good way to start running as a beginner?",
    "Explain what a black hole is to a ten-year-old.",
    "Why is exercise good for the brain?",
    "What are the main ingredients of a pizza?",
    "Describe a sunset over the mountains.",
    "How can I sleep better at night?",
    "What is the water cycle?",
    "Tell me a fun fact about octopuses.",
    "How do airplanes stay in the air?",
    "What makes a good friend?",
    "Write a limerick about a forgetful robot.",
)


def chat_requests(tokenizer, num_prompts: int = 12, seed: int = 0, output_len: int = 128,
                  exclude: list[BenchRequest] | tuple = ()) -> list[BenchRequest]:
    """`num_prompts` questions in the order of `default_rng(seed).permutation`, skipping those
    whose prompts are in `exclude`."""
    if tokenizer is None:
        raise ValueError("the chat workload needs a model with a tokenizer and a chat template")
    taken = {tuple(r.prompt_token_ids) for r in exclude}
    requests = []
    for i in np.random.default_rng(seed).permutation(len(QUESTIONS)):
        ids = chat_prompt_ids(tokenizer, QUESTIONS[i])
        if tuple(ids) not in taken:
            requests.append(BenchRequest(ids, output_len))
        if len(requests) == num_prompts:
            return requests
    raise ValueError(f"chat workload: {len(QUESTIONS)} questions, fewer than {num_prompts} prompts "
                     f"(with {len(exclude)} held out for the other set); lower --num-prompts")
