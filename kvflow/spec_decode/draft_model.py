"""Draft-model proposer: a smaller model with the target's vocabulary guesses k tokens.

The draft runs in its own paged KV cache (its own block pool, planned beside the target's:
both hold the same number of tokens, see `engine/memory_plan.py`) through an ordinary
`ModelRunner`, so it uses the same kernels, chunking and numerics as the target. Each
proposal is k small steps over every speculating sequence at once:
  1. catch-up: the tokens the draft has not seen yet (the whole prompt the first time,
     afterwards the target's last token plus whatever of the previous drafts was kept);
  2. k - 1 single-token steps, each feeding the previous guess.
The draft's K/V past the kept tokens is dropped at the next proposal (the common prefix of
what the draft saw and what the sequence holds), exactly as the target rolls back.

A self-draft (the target's own checkpoint under another quantization, `shares_target_kv`)
has no cache of its own: it reads the target's K/V of the sequence, which the target has
computed for every token but the last, and writes its own K/V only at the positions the
target's next step rewrites (the last token and the guesses, in the sequence's own blocks
past its computed tokens). So it never catches up (no second prefill of every prompt, which
at one thread cost as much as the target's), never rolls back, and needs no pool of its own.
The blocks it takes for its guesses go back before the step is scheduled. Its guesses are
the int4 model's over the target's keys and values: a proposal like any other, which the
verification keeps or rejects exactly.

Greedy requests take the draft's argmax. Sampled requests draw each guess from the draft's
own distribution q under the request's sampling parameters (temperature, top-k/top-p/min-p,
penalties seeing earlier guesses), with the request's generator, and hand q to the
rejection sampler, which keeps the target's distribution exact whatever q is.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvflow.config import ModelConfig
from kvflow.engine.kv_cache_manager import KVCacheManager
from kvflow.engine.memory_plan import KVCachePlan
from kvflow.engine.model_runner import ModelRunner
from kvflow.layers import cpu_kernels
from kvflow.layers.attention import AttentionBackend, AttentionMetadata
from kvflow.loader import load_model, load_model_config, resolve_model_path
from kvflow.quantization.config import QuantizationConfig
from kvflow.engine.scheduler import ScheduledSequence, SchedulerOutput
from kvflow.sampling.sampler import SamplingMetadata, apply_logits_processors, exponential_race, filter_logits, greedy

if TYPE_CHECKING:
    from kvflow.engine.sequence import Sequence
    from kvflow.spec_decode.config import SpeculativeConfig


DRAFT_SEED_SALT = 0x5EED_D4AF7


@dataclass(eq=False)
class DraftSequence:
    """What the draft model has seen of one request: the shape `ModelRunner` reads."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens of token_ids whose K/V is in the draft's cache
    # A seeded request's guesses come from a stream of their own, so that guessing never
    # shifts the request's generator, which verification alone draws from.
    generator: torch.Generator | None = None
    pooling = None  # never an embedding request (ModelRunner asks); not a field

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.token_ids[start:end]


@dataclass
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None  # [k, V] draft distribution of each guess; None for greedy requests


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, runner: ModelRunner, kv: KVCacheManager, eos_token_ids: list[int],
                 max_catch_up_tokens: int = 2048, shares_target_kv: bool = False) -> None:
        self.model, self.runner, self.kv = model, runner, kv
        # True: `kv` and the runner's caches are the target's own (a self-draft; see the module docstring).
        self.shares_target_kv = shares_target_kv
        self.eos_token_ids = eos_token_ids
        # Tokens the draft may catch up on per step (the target's token budget): a long prompt
        # is caught up over several steps, without guesses until it is done.
        self.max_catch_up_tokens = max_catch_up_tokens
        self._seen: dict[str, DraftSequence] = {}

    @torch.inference_mode()
    def propose(self, seqs: list["Sequence"], num_tokens: list[int]) -> list[Proposal]:
        """Up to num_tokens[i] guesses for seqs[i]; fewer (or none) when the draft's pool is full."""
        if self.shares_target_kv:
            return self._propose_shared(seqs, num_tokens)
        views, ks, rows, chunks = [], [], [], []
        budget = self.max_catch_up_tokens
        for i, (seq, k) in enumerate(zip(seqs, num_tokens)):
            if k < 1 or budget < 1:
                continue
            view = self._catch_up(seq)
            if view is None:
                continue
            chunk = min(view.num_tokens - view.num_computed_tokens, budget)
            budget -= chunk
            views.append(view)
            ks.append(k)
            rows.append(i)
            chunks.append(chunk)
        drafts: list[list[int]] = [[] for _ in views]
        probs: list[list[torch.Tensor]] = [[] for _ in views]
        active = list(range(len(views)))
        while active:
            # One-token rows first, as the scheduler orders a batch (the attention metadata's decode rows).
            active.sort(key=lambda a: chunks[a] > 1)
            items = [ScheduledSequence(views[a], chunks[a]) for a in active]
            inputs = self.runner.prepare_inputs(SchedulerOutput(items))
            hidden = self.model(inputs.input_ids, inputs.positions, self.runner.kv_caches, inputs.attn_metadata)
            for a in active:
                views[a].num_computed_tokens += chunks[a]
            active = [a for a in active if views[a].num_computed_tokens == views[a].num_tokens]  # caught up
            if not active:
                break
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            tokens, q = self._sample(logits, [seqs[rows[a]] for a in active], [drafts[a] for a in active],
                                     [views[a].generator for a in active])
            for a in active:
                chunks[a] = 1
            active = self._record_guesses(active, tokens, q, views, ks, drafts, probs)
        return _proposals(len(seqs), rows, drafts, probs)

    def _propose_shared(self, seqs: list["Sequence"], num_tokens: list[int]) -> list[Proposal]:
        """A self-draft's proposal: every row is one token (the sequence's last, then each guess)
        over the target's cache, so each of the k forwards gets its inputs built directly
        (`_decode_inputs`) instead of through the runner's general chunk layout: at batch 1 the
        Python around a ~5 ms int4 forward is a tenth of a speculative step."""
        views, ks, rows = [], [], []
        for i, (seq, k) in enumerate(zip(seqs, num_tokens)):
            view = self._shared_view(seq) if k > 0 else None
            if view is not None:
                views.append(view)
                ks.append(k)
                rows.append(i)
        drafts: list[list[int]] = [[] for _ in views]
        probs: list[list[torch.Tensor]] = [[] for _ in views]
        active = list(range(len(views)))
        while active:
            input_ids, positions, meta = self._decode_inputs([views[a] for a in active])
            with _units_for(len(active)):
                logits = self.model.compute_logits(self.model(input_ids, positions, self.runner.kv_caches, meta))
            tokens, q = self._sample(logits, [seqs[rows[a]] for a in active],
                                     [drafts[a] for a in active], [views[a].generator for a in active])
            for a in active:
                views[a].num_computed_tokens += 1
            active = self._record_guesses(active, tokens, q, views, ks, drafts, probs)
        for i in rows:  # the blocks taken for guesses go back; the target's step allocates its own
            self.kv.trim(seqs[i])
        return _proposals(len(seqs), rows, drafts, probs)

    def _record_guesses(self, active: list[int], tokens: list[int], q, views: list[DraftSequence], ks: list[int],
                        drafts: list[list[int]], probs: list[list[torch.Tensor]]) -> list[int]:
        """Append each active view's new guess (and the distribution it was drawn from); the
        views that still want guesses and got a slot for feeding this one back."""
        still = []
        for j, a in enumerate(active):
            drafts[a].append(tokens[j])
            if q is not None and q[j] is not None:
                probs[a].append(q[j])
            if len(drafts[a]) < ks[a] and self.kv.allocate_slots(views[a], 1):
                views[a].token_ids.append(tokens[j])
                still.append(a)
        return still

    def _decode_inputs(self, views: list[DraftSequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """One new token per view, each a decode row: what `ModelRunner.prepare_inputs` builds
        for such a batch (the same tensors), without its numpy layout for chunks."""
        bs, n = self.kv.block_size, len(views)
        positions = [v.num_computed_tokens for v in views]
        tables = [self.kv.block_table(v.request_id) for v in views]
        width = max(map(len, tables))
        seq_lens = [p + 1 for p in positions]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, positions)], dtype=torch.int64),
            query_start_loc=list(range(n + 1)), seq_lens=seq_lens,
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64),
            num_decodes=n, block_size=bs, query_start_tensor=torch.arange(n + 1, dtype=torch.int64),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64))
        input_ids = torch.tensor([v.token_ids[p] for v, p in zip(views, positions)], dtype=torch.int64)
        return input_ids, torch.tensor(positions, dtype=torch.int64), meta

    def _view(self, seq: "Sequence") -> DraftSequence:
        view = self._seen.get(seq.request_id)
        if view is None:
            seed = seq.params.seed
            generator = torch.Generator().manual_seed(seed ^ DRAFT_SEED_SALT) if seed is not None else None
            view = self._seen[seq.request_id] = DraftSequence(seq.request_id, generator=generator)
        return view

    def _shared_view(self, seq: "Sequence") -> DraftSequence | None:
        """A self-draft starts where the target's K/V ends (all tokens but the last) and needs
        slots in the target's pool for the last token and the guesses it feeds."""
        view = self._view(seq)
        view.token_ids = list(seq.all_token_ids)  # guesses are appended to this copy
        view.num_computed_tokens = seq.num_computed_tokens
        if not self.kv.allocate_slots(view, view.num_tokens - view.num_computed_tokens):
            return None  # no room: this sequence decodes without guesses this step
        return view

    def _catch_up(self, seq: "Sequence") -> DraftSequence | None:
        """Roll the draft back to what it saw that still stands, and give it slots for the rest."""
        view = self._view(seq)
        tokens = seq.all_token_ids
        keep = min(view.num_computed_tokens, len(tokens) - 1)  # the last token is always fed again
        start = max(0, keep - len(seq.output_token_ids) - 1)  # before that, tokens never change
        while start < keep and view.token_ids[start] == tokens[start]:
            start += 1
        view.num_computed_tokens = start
        self.kv.trim(view)
        view.token_ids = tokens
        if not self.kv.allocate_slots(view, view.num_tokens - view.num_computed_tokens):
            self.forget(seq.request_id)  # no room: this sequence decodes without guesses this step
            return None
        return view

    def _sample(self, logits: torch.Tensor, seqs: list["Sequence"], drafts: list[list[int]],
                generators: list[torch.Generator | None]):
        """Each row's guess, and for sampled requests the distribution it was drawn from."""
        if all(s.params.is_greedy and not s.params.edits_logits and s.params.min_tokens <= len(s.output_token_ids)
               + len(d) for s, d in zip(seqs, drafts)):
            return greedy(logits).tolist(), None  # what the metadata below comes to for such rows
        meta = SamplingMetadata.build(
            params=[s.params for s in seqs], prompt_token_ids=[s.prompt_token_ids for s in seqs],
            output_token_ids=[s.output_token_ids + d if s.params.reads_output or s.params.min_tokens > len(
                s.output_token_ids) else s.output_token_ids for s, d in zip(seqs, drafts)],
            generators=generators, eos_token_ids=self.eos_token_ids, vocab_size=logits.shape[-1],
            bad_words_token_ids=[s.bad_words_token_ids for s in seqs])
        scores = apply_logits_processors(logits, meta)
        tokens = greedy(scores).tolist()
        if meta.random_rows is None:
            return tokens, None
        q: list[torch.Tensor | None] = [None] * len(seqs)
        filtered = filter_logits(scores[meta.random_rows], meta)
        for j, row in enumerate(meta.random_rows.tolist()):
            tokens[row] = exponential_race(filtered[j], generators[row])
            q[row] = filtered[j].softmax(dim=-1)
        return tokens, q

    def forget(self, request_id: str) -> None:
        view = self._seen.pop(request_id, None)
        if view is not None and not self.shares_target_kv:  # shared blocks are the target sequence's
            self.kv.free(view)


def _units_for(rows: int) -> contextlib.AbstractContextManager:
    """Where a self-draft's forward of `rows` one-token rows runs: one row on the vector units
    (`CPUKernels.vector_units`: 4-bit groups decode faster there than on AMX tiles), more on
    whatever the target uses. The draft's bits do not matter: the target verifies every guess.
    Its weights are packed inside `_units_for(1)` too, so its 4-bit tiles take the k-pair layout
    both units read (AMX folds it), not the AMX-only row layout."""
    kernels = cpu_kernels.load() if rows == 1 else None
    return kernels.vector_units() if kernels is not None else contextlib.nullcontext()


def _proposals(num_seqs: int, rows: list[int], drafts: list[list[int]],
               probs: list[list[torch.Tensor]]) -> list[Proposal]:
    out = [Proposal([], None) for _ in range(num_seqs)]
    for a, i in enumerate(rows):
        out[i] = Proposal(drafts[a], torch.stack(probs[a]) if probs[a] else None)
    return out


def draft_model_config(config: "SpeculativeConfig", target: ModelConfig, max_model_len: int) -> tuple[str, ModelConfig]:
    """The draft's path and shape, refused before any weight loads if its vocabulary differs or
    its context is shorter than the sequences it must follow."""
    try:
        path = resolve_model_path(config.model)
        cfg = load_model_config(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocabulary has {cfg.vocab_size:,} tokens, the "
                         f"target's {target.vocab_size:,}; a draft must share the target's tokenizer")
    context = min(cfg.max_position_embeddings, cfg.sliding_window or cfg.max_position_embeddings)
    if context < max_model_len:
        raise ValueError(f"speculative_config.model: the draft attends over {context:,} positions, fewer than "
                         f"max_model_len={max_model_len:,}; lower max_model_len or choose a longer-context draft")
    return path, cfg


def shares_target_kv(target_path: str, target: ModelConfig, draft_path: str, draft: ModelConfig,
                     device: str = "cpu") -> bool:
    """Whether the draft is the target's own checkpoint (a self-draft, under another
    quantization), which then reads and writes the target's KV cache instead of its own: the
    same layers, heads and positions, so the target's K/V is what the draft's own would be up
    to the quantization. On the CPU, where both models run in one process on one pool."""
    return device == "cpu" and os.path.realpath(target_path) == os.path.realpath(draft_path) and target == draft


def load_draft_proposer(path: str, cfg: ModelConfig, plan: KVCachePlan, dtype: torch.dtype,
                        attn_backend: AttentionBackend, eos_token_ids: list[int], seed: int = 0,
                        target_vocab: dict[str, int] | None = None, draft_vocab: dict[str, int] | None = None,
                        max_catch_up_tokens: int = 2048, quantization: QuantizationConfig | None = None,
                        target_runner: ModelRunner | None = None) -> DraftModelProposer:
    """Load the draft's weights (quantized as `quantization` says) and give it a KV pool as
    large (in tokens) as the target's, or, with `target_runner` (a self-draft, see
    `shares_target_kv`), the target's own pool and caches."""
    if target_vocab is not None and draft_vocab is not None and target_vocab != draft_vocab:
        differ = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()))[:3]
        raise ValueError(f"speculative_config.model: the draft's tokenizer maps tokens differently from the "
                         f"target's (e.g. {differ}); a draft must share the target's tokenizer")
    with _units_for(1):  # its 4-bit tiles in the layout the vector units read (tiles.pack)
        model = load_model(path, cfg, dtype, attn_backend, "auto", seed, quantization)
    if target_runner is not None:
        runner = ModelRunner(model, attn_backend, cfg, target_runner.kv, dtype, eos_token_ids,
                             kv_caches=target_runner.kv_caches)
        return DraftModelProposer(model, runner, target_runner.kv, eos_token_ids, max_catch_up_tokens,
                                  shares_target_kv=True)
    kv = KVCacheManager(plan.num_blocks, plan.block_size, enable_prefix_caching=False)
    runner = ModelRunner(model, attn_backend, cfg, kv, dtype, eos_token_ids)
    return DraftModelProposer(model, runner, kv, eos_token_ids, max_catch_up_tokens)
