"""Batched next-token sampling over one step's logits.

`SamplingMetadata.build` turns the per-request `SamplingParams` of the rows sampled this step
into batch tensors once, and records which stages are needed at all, so `Sampler` skips
whatever no row asked for. A batch of plain greedy requests (the common benchmark and
eval case) costs a single argmax.

Stage order follows vLLM: the structured-output bitmask (`bitmask.py`), the request's own
logit edits (`logits_processors.py`: allowed_token_ids, bad_words, min_tokens, logit_bias),
penalties, then greedy rows take the argmax and
random rows go through temperature, top-k, top-p and min-p before one draw. Random rows are
sampled with the exponential race (equivalently Gumbel-max): token = argmax(p_i / q_i) with
q_i ~ Exp(1), computed in log space as argmax(x_i - log q_i) on the filtered, tempered
logits x, which needs no softmax and no renormalisation after filtering. Each seeded row
draws its q from its own generator only, so a request's tokens depend on its seed and never
on which other requests share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvflow.layers import cpu_kernels
from kvflow.outputs import Logprob
from kvflow.sampling.bitmask import apply_token_bitmask
from kvflow.sampling.logits_processors import LogitsEdits
from kvflow.sampling.params import SamplingParams

_NEG_INF = float("-inf")


def generator_for(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request RNG a seeded request keeps for its whole life (None when unseeded)."""
    if params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


@dataclass
class SamplingMetadata:
    """Batch tensors for one sampling step; one row per sequence sampled.

    Optional tensors are None when no row needs that stage, which is how `Sampler` knows to
    skip it. Per-row tensors of the random stages (temperature, top_k, top_p, min_p) hold
    only the random rows, in the order of `random_rows`.
    """

    num_rows: int
    vocab_size: int
    # True only when every row is greedy and nothing else (penalties, logit edits, logprobs) is
    # needed: the sampler then does a bare argmax.
    all_greedy: bool
    num_logprobs: list[int | None] = field(default_factory=list)
    random_rows: torch.Tensor | None = None  # long [R]; None when no row is random
    all_random: bool = False
    random_generators: list[torch.Generator | None] = field(default_factory=list)
    temperature: torch.Tensor | None = None  # float [R]
    top_k: torch.Tensor | None = None  # long [R]; vocab_size where disabled
    top_p: torch.Tensor | None = None  # float [R]; 1.0 where disabled
    min_p: torch.Tensor | None = None  # float [R]; 0.0 where disabled
    repetition_penalty: torch.Tensor | None = None  # float [N]
    seen_mask: torch.Tensor | None = None  # bool [N, V]: token in prompt or output
    presence_penalty: torch.Tensor | None = None  # float [N]
    frequency_penalty: torch.Tensor | None = None  # float [N]
    output_counts: torch.Tensor | None = None  # float [N, V]: occurrences in output
    edits: LogitsEdits | None = None  # allowed_token_ids, bad_words, min_tokens, logit_bias
    # Structured output: (rows [C] long, bitmask [C, ceil(V/32)] int32) of the constrained rows.
    token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: list[int],
        vocab_size: int,
        *,
        device: torch.device | str = "cpu",
        token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None,
        bad_words_token_ids: list[list[list[int]]] | None = None,
    ) -> "SamplingMetadata":
        """Precompute everything this step needs; tensors that no row needs are never built.

        `token_bitmask` (rows, packed allowed tokens) restricts structured-output rows; see `bitmask.py`.
        `bad_words_token_ids[i]` are row i's banned words as token ids (`logits_processors.bad_words_token_ids`).
        """
        n = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == n):
            raise ValueError(
                "params, prompt_token_ids, output_token_ids and generators must have one entry per row"
            )
        num_logprobs = [p.logprobs for p in params]
        random_idx = [i for i, p in enumerate(params) if not p.is_greedy]
        penalised = any(p.has_penalties for p in params)
        edits = LogitsEdits.build(params, output_token_ids, eos_token_ids, vocab_size, bad_words_token_ids, device)
        wants_logprobs = any(k is not None for k in num_logprobs)
        if not random_idx and not penalised and edits is None and not wants_logprobs:
            return cls(num_rows=n, vocab_size=vocab_size, all_greedy=True, num_logprobs=num_logprobs,
                       token_bitmask=token_bitmask)

        meta = cls(num_rows=n, vocab_size=vocab_size, all_greedy=False, num_logprobs=num_logprobs,
                   token_bitmask=token_bitmask, edits=edits)
        if penalised:
            meta._build_penalties(params, prompt_token_ids, output_token_ids, device)
        if random_idx:
            meta._build_random(params, random_idx, generators, device)
        return meta

    def _build_random(
        self,
        params: list[SamplingParams],
        random_idx: list[int],
        generators: list[torch.Generator | None],
        device: torch.device | str,
    ) -> None:
        rows = [params[i] for i in random_idx]
        v = self.vocab_size
        self.random_rows = torch.tensor(random_idx, dtype=torch.long, device=device)
        self.all_random = len(random_idx) == self.num_rows
        self.random_generators = [generators[i] for i in random_idx]
        self.temperature = _f32([p.temperature for p in rows], device)
        if any(0 < p.top_k < v for p in rows):
            ks = [p.top_k if 0 < p.top_k < v else v for p in rows]
            self.top_k = torch.tensor(ks, dtype=torch.long, device=device)
        if any(p.top_p < 1.0 for p in rows):
            self.top_p = _f32([p.top_p for p in rows], device)
        if any(p.min_p > 0.0 for p in rows):
            self.min_p = _f32([p.min_p for p in rows], device)

    def _build_penalties(
        self,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        device: torch.device | str,
    ) -> None:
        n, v = self.num_rows, self.vocab_size
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            rows, cols = _flatten(output_token_ids, v, device)
            counts = torch.zeros(n, v, dtype=torch.float32, device=device)
            counts.index_put_((rows, cols), torch.ones_like(cols, dtype=torch.float32), accumulate=True)
            self.output_counts = counts
            self.presence_penalty = _f32([p.presence_penalty for p in params], device)
            self.frequency_penalty = _f32([p.frequency_penalty for p in params], device)
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = torch.zeros(n, v, dtype=torch.bool, device=device)
            for ids in (prompt_token_ids, output_token_ids):
                rows, cols = _flatten(ids, v, device)
                seen[rows, cols] = True
            self.seen_mask = seen
            self.repetition_penalty = _f32([p.repetition_penalty for p in params], device)


def _f32(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _flatten(
    token_ids: list[list[int]], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs for a ragged batch, dropping ids outside the logits' vocab."""
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)
    cols = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long)
    keep = (cols >= 0) & (cols < vocab_size)
    return rows[keep].to(device), cols[keep].to(device)


@dataclass
class SamplerOutput:
    """One sampled token per row, plus logprobs for rows that asked for them.

    `logprobs[i]` maps token id to the `Logprob` of the sampled token and the row's top-k tokens.
    """

    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


class Sampler:
    """Picks the next token of every row of a [N, V] float32 logits batch.

    Logprobs are taken from log_softmax of the logits after the grammar bitmask, the request's
    logit edits and the penalties but before temperature and top-k/top-p/min-p, as vLLM's default
    ("raw" model distribution as seen by this request): they then describe the model's
    belief, comparable across requests whatever their sampling knobs, and never report
    -inf for a token merely because a truncation filter dropped it.
    """

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if meta.token_bitmask is not None:  # first: every later stage sees only allowed tokens
            logits = apply_token_bitmask(logits, *meta.token_bitmask)
        if meta.all_greedy:
            return SamplerOutput(
                token_ids=greedy(logits).tolist(),
                logprobs=[None] * meta.num_rows,
            )
        logits = apply_logits_processors(logits, meta)

        if meta.random_rows is None:
            sampled = greedy(logits)
        elif meta.all_random:
            sampled = _sample_random(logits, meta)
        else:
            sampled = greedy(logits)
            sampled[meta.random_rows] = _sample_random(logits[meta.random_rows], meta)

        token_ids = sampled.tolist()
        return SamplerOutput(token_ids=token_ids, logprobs=gather_logprobs(logits, sampled, meta.num_logprobs))


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The request's view of the model: float32 logits after its own edits (allowed_token_ids,
    bad_words, min_tokens, logit_bias) and the penalties.

    Logprobs are read here and greedy rows take their argmax here; random rows go on
    through `filter_logits`. HF-style repetition penalty over prompt+output, OpenAI
    presence/frequency over output.
    """
    logits = logits.to(torch.float32)
    if meta.edits is not None:
        logits = meta.edits.apply(logits)
    if meta.repetition_penalty is not None and meta.seen_mask is not None:
        r = meta.repetition_penalty.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(meta.seen_mask, penalised, logits)
    if meta.output_counts is not None:
        counts = meta.output_counts
        logits = (
            logits
            - meta.frequency_penalty.unsqueeze(1) * counts
            - meta.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
        )
    return logits


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax, lowest index on ties (a row's first NaN where it has one). On the CPU,
    kvflow's kernel (csrc/sampling.cpp: a [32, 49152] float32 batch 441 -> ~60 us, one row 95 ->
    ~10 us); else `max(dim)`, measured 1.8x faster than `argmax` there, with the same rule."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1 \
            and logits.shape[1] > 0:
        kernels = cpu_kernels.load()
        if kernels is not None:
            return kernels.argmax_rows(logits)
    return logits.max(dim=-1).indices


def _sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one exponential-race draw per row."""
    x = filter_logits(logits, meta)
    q = _exponential_noise(x, meta.random_generators)
    return (x - q.log()).argmax(dim=-1)


def filter_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The random rows' sampling distribution, as logits: softmax of the result is what is drawn from.

    `logits` holds only the random rows, in the order of `meta.random_rows`. Temperature,
    then top-k and top-p by sorted position, then min-p; filtered tokens become -inf.
    """
    x = logits / meta.temperature.unsqueeze(1)
    if meta.top_k is not None or meta.top_p is not None:
        x = _apply_top_k_top_p(x, meta.top_k, meta.top_p)
    if meta.min_p is not None:
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p); log(0) = -inf bans nothing.
        threshold = x.amax(dim=-1, keepdim=True) + meta.min_p.log().unsqueeze(1)
        x = x.masked_fill(x < threshold, _NEG_INF)
    return x


def exponential_race(x: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from softmax(x) for a single row, with Exp(1) noise from `generator`.

    The same length-V draw a seeded row makes in a batched step, so a request's stream
    advances by the same amount whichever path samples it.
    """
    q = torch.empty_like(x).exponential_(generator=generator).clamp_(min=torch.finfo(x.dtype).tiny)
    return int((x - q.log()).argmax())


def _apply_top_k_top_p(
    x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask by sorted position, so top_k=1 and tiny top_p both keep exactly the argmax token."""
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        positions = torch.arange(x.shape[-1], device=x.device).unsqueeze(0)
        sorted_x = sorted_x.masked_fill(positions >= top_k.unsqueeze(1), _NEG_INF)
    if top_p is not None:
        probs = sorted_x.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # The first token has mass_before == 0 < top_p, so at least one always survives;
        # rows with top_p == 1 are exempt from float-rounding overshoot of the cumsum.
        drop = (mass_before > top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        sorted_x = sorted_x.masked_fill(drop, _NEG_INF)
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def _exponential_noise(x: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise shaped like x; seeded rows draw only from their own generator.

    Each seeded row gets a fresh length-V draw, so its stream advances by the same amount
    whatever the batch; unseeded rows share one draw from the default RNG.
    """
    rows, vocab = x.shape
    q = torch.empty_like(x)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < rows:
        if not seeded:
            q.exponential_()
        else:
            unseeded = [i for i, g in enumerate(generators) if g is None]
            idx = torch.tensor(unseeded, dtype=torch.long, device=x.device)
            q[idx] = torch.empty(len(unseeded), vocab, dtype=x.dtype, device=x.device).exponential_()
    for i in seeded:
        q[i] = torch.empty(vocab, dtype=x.dtype, device=x.device).exponential_(generator=generators[i])
    # exponential_ can return exactly 0; log(0) = -inf would turn a banned -inf logit into nan.
    return q.clamp_(min=torch.finfo(x.dtype).tiny)


def gather_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, num_logprobs: list[int | None]
) -> list[dict[int, Logprob] | None]:
    """For rows that asked: the chosen token's logprob and measured rank, and the top k ranked 1..k.

    `chosen` is the sampled token of each row (or, for prompt logprobs, the prompt's next token).
    A chosen token among the top k appears once, with its measured rank. `decoded_token` is left
    for the engine, which holds the tokenizer.
    """
    n = logits.shape[0]
    want = [i for i, k in enumerate(num_logprobs) if k is not None]
    if not want:
        return [None] * n
    idx = torch.tensor(want, dtype=torch.long, device=logits.device)
    lp = torch.log_softmax(logits[idx], dim=-1)
    picked = chosen[idx].unsqueeze(1)
    picked_lp = lp.gather(1, picked)
    ranks_t = (lp > picked_lp).sum(dim=-1) + 1
    max_k = max(num_logprobs[i] or 0 for i in want)
    top_lp, top_ids = lp.topk(max_k, dim=-1) if max_k > 0 else (lp[:, :0], picked[:, :0])
    top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
    picked_l, picked_lp_l = picked.squeeze(1).tolist(), picked_lp.squeeze(1).tolist()
    ranks_l = ranks_t.tolist()

    logprobs: list[dict[int, Logprob] | None] = [None] * n
    for j, i in enumerate(want):
        k = num_logprobs[i] or 0
        entry = {picked_l[j]: Logprob(picked_lp_l[j], ranks_l[j])}  # first, as vLLM orders them
        for rank, (t, v) in enumerate(zip(top_ids_l[j][:k], top_lp_l[j][:k]), start=1):
            if t not in entry:
                entry[t] = Logprob(v, rank)
        logprobs[i] = entry
    return logprobs
