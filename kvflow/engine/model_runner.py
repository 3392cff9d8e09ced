"""Turns a scheduler decision into flat tensors, runs the model, and samples.

The runner owns the model and the KV cache (one pool, allocated by the attention backend;
a [2, num_blocks, block_size, kv_heads, head_dim] view of it per layer). Per step it
builds, without per-token Python loops:
  input_ids, positions  [num_tokens]   the new tokens of every scheduled sequence, concatenated
  slot_mapping          [num_tokens]   where each new token's K/V goes in the pool
  block_tables          [num_seqs, max_blocks]
  logits_indices        [num_sampled]  the last token of every sequence that completes this step
Only those rows go through the LM head and the sampler. A speculating sequence's draft tokens
follow its last token in the same row of the batch, like a short prefill chunk; its last
1 + k positions are all sampled rows, and the rejection sampler decides which drafts stand.
A request with prompt_logprobs also sends its chunk's prompt rows through the LM head, a
slice at a time (`prompt_logprobs.py`). An embedding request's rows go to the pooler instead
of the LM head (`kvflow/pooling/pooler.py`); it is never sampled. With LoRA adapters, the LoRA
manager learns each row's adapter before the forward pass (kvflow/lora/manager.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from kvflow.config import ModelConfig
from kvflow.engine.kv_cache_manager import KVCacheManager
from kvflow.engine.prompt_logprobs import PromptLogprobChunk, compute_prompt_logprobs
from kvflow.engine.scheduler import ScheduledSequence, SchedulerOutput
from kvflow.engine.sequence import Sequence
from kvflow.layers.attention import AttentionBackend, AttentionMetadata
from kvflow.outputs import Logprob
from kvflow.pooling.pooler import PooledOutput, pool_step
from kvflow.sampling.sampler import Sampler, SamplingMetadata, greedy
from kvflow.spec_decode.rejection_sampler import RejectionSampler, verify_greedy
from kvflow.structured_output.manager import fill_token_bitmask


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # 1 row per sampled sequence, 1 + k for a speculating one
    sampled: list[ScheduledSequence]


@dataclass
class SampledTokens:
    """What one sequence gained this step: one token, or accepted drafts plus one."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None  # one entry per token, when the request asked
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def num_rejected_tokens(self) -> int:
        return self.num_draft_tokens - self.num_accepted_tokens


@dataclass
class StepOutput:
    """What one step computed: tokens of the sequences that completed their chunk, new
    prompt logprob entries of the sequences that asked for them (partial chunks included), and
    the vectors of embedding requests whose prompt the step completed."""

    sampled: list[SampledTokens]
    prompt_logprobs: list[PromptLogprobChunk]
    pooled: list[PooledOutput] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        attn_backend: AttentionBackend,
        model_config: ModelConfig,
        kv_cache_manager: KVCacheManager,
        dtype: torch.dtype,
        eos_token_ids: list[int],
        kv_cache_dtype: str = "auto",
        device: torch.device | str = "cpu",
        kv_caches: list | None = None,
    ) -> None:
        """`kv_caches`: another runner's caches to run on instead of allocating a pool (a
        self-draft shares its target's, spec_decode/draft_model.py)."""
        self.model, self.model_config, self.kv = model, model_config, kv_cache_manager
        self.device = torch.device(device)
        self.block_size = kv_cache_manager.block_size
        self.eos_token_ids = eos_token_ids
        self.kv_caches = kv_caches if kv_caches is not None else attn_backend.allocate_kv_caches(
            model_config.num_hidden_layers, kv_cache_manager.num_blocks, self.block_size,
            model_config.num_key_value_heads, model_config.head_dim, dtype, kv_cache_dtype)
        self.decode_graphs = None  # CUDA graphs of decode steps, once captured
        self.lora = None  # kvflow.lora.LoRAManager when the engine serves adapters
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInput:
        items = out.scheduled
        starts = np.fromiter((it.seq.num_computed_tokens for it in items), dtype=np.int64, count=len(items))
        lens = np.fromiter((it.num_new_tokens for it in items), dtype=np.int64, count=len(items))
        query_start = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum(lens, out=query_start[1:])
        total = int(query_start[-1])

        token_ids: list[int] = []
        for it, start in zip(items, starts.tolist()):
            token_ids.extend(it.seq.token_slice(start, start + it.num_new_tokens - len(it.spec_token_ids)))
            token_ids.extend(it.spec_token_ids)
        row_of_token = np.repeat(np.arange(len(items)), lens)
        positions = np.arange(total, dtype=np.int64) - query_start[:-1][row_of_token] + starts[row_of_token]

        tables = [self.kv.block_table(it.seq.request_id) for it in items]
        block_tables = np.zeros((len(items), max(len(t) for t in tables)), dtype=np.int64)
        for row, table in enumerate(tables):
            block_tables[row, : len(table)] = table
        slot_mapping = block_tables[row_of_token, positions // self.block_size] * self.block_size + positions % self.block_size

        seq_lens = starts + lens
        num_decodes = int(np.argmax(lens > 1)) if (lens > 1).any() else len(items)
        sampled = [i for i, it in enumerate(items) if it.needs_logits]
        ends = query_start[1:][sampled]
        num_rows = np.fromiter((1 + len(items[i].spec_token_ids) for i in sampled), dtype=np.int64, count=len(sampled))
        if len(sampled) == 0 or num_rows.max() == 1:
            logits_indices = ends - 1
        else:  # a speculating sequence's last 1 + k positions, in order
            first = np.repeat(ends - num_rows, num_rows)
            logits_indices = first + np.arange(int(num_rows.sum())) - np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping),
            query_start_loc=query_start.tolist(),
            seq_lens=seq_lens.tolist(),
            block_tables=torch.from_numpy(block_tables),
            num_decodes=num_decodes,
            block_size=self.block_size,
            query_start_tensor=torch.from_numpy(query_start),
            seq_lens_tensor=torch.from_numpy(seq_lens),
        )
        return ModelInput(
            input_ids=torch.tensor(token_ids, dtype=torch.int64),
            positions=torch.from_numpy(positions),
            attn_metadata=meta,
            logits_indices=torch.from_numpy(logits_indices),
            sampled=[items[i] for i in sampled],
        )

    def _to_device(self, inputs: ModelInput) -> ModelInput:
        """The step's tensors on the model's device (built on the host with numpy)."""
        if self.device.type == "cpu":
            return inputs
        return dataclasses.replace(
            inputs, input_ids=inputs.input_ids.to(self.device, non_blocking=True),
            positions=inputs.positions.to(self.device, non_blocking=True),
            attn_metadata=inputs.attn_metadata.to(self.device),
            logits_indices=inputs.logits_indices.to(self.device, non_blocking=True))

    def _forward(self, inputs: ModelInput) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)

    def capture_decode_graphs(self, max_model_len: int, max_num_seqs: int) -> None:
        """CUDA: record decode forwards for replay (`cuda_graphs.py`); other steps stay eager."""
        from kvflow.engine.cuda_graphs import DecodeGraphs

        def forward(input_ids, positions, meta):
            return self.model(input_ids, positions, self.kv_caches, meta)

        graphs = DecodeGraphs(forward, self.device, self.block_size, max_model_len, max_num_seqs)
        graphs.capture()
        self.decode_graphs = graphs

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepOutput:
        host = self.prepare_inputs(out)
        lora_rows = self.lora is not None and self.lora.set_step([it.seq.lora_int_id for it in out.scheduled],
                                                                 [it.num_new_tokens for it in out.scheduled])
        if self.decode_graphs is not None and not lora_rows and self.decode_graphs.fits(host.attn_metadata):
            hidden = self.decode_graphs.run(host.input_ids, host.positions, host.attn_metadata)
            inputs = dataclasses.replace(host, logits_indices=host.logits_indices.to(self.device))
        else:
            inputs = self._to_device(host)
            hidden = self._forward(inputs)
        query_start = inputs.attn_metadata.query_start_loc
        prompt_logprobs = compute_prompt_logprobs(hidden, out.scheduled, query_start, self.model.compute_logits)
        pooled = pool_step(hidden, out.scheduled, query_start)
        if not inputs.sampled:
            return StepOutput([], prompt_logprobs, pooled)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        if not any(it.spec_token_ids for it in inputs.sampled):
            return StepOutput(self.sample(logits, [it.seq for it in inputs.sampled]), prompt_logprobs, pooled)
        return StepOutput(self.sample_speculative(logits, inputs.sampled), prompt_logprobs, pooled)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledTokens]:
        meta = self._sampling_metadata(seqs, [s.output_token_ids for s in seqs], logits.shape[-1])
        if any(s.grammar_state is not None for s in seqs):  # structured output: allowed tokens of each row
            meta.token_bitmask = fill_token_bitmask([s.grammar_state for s in seqs], logits.shape[-1])
        if logits.device.type != "cpu" and not (meta.all_greedy and meta.token_bitmask is None):
            # Everything but a plain greedy batch samples on the host, where the seeded
            # generators and the sampling metadata live: a request's draws are the same on any device.
            logits = logits.cpu()
        result = self.sampler(logits, meta)
        return [SampledTokens(s, [t], None if lp is None else [lp])
                for s, t, lp in zip(seqs, result.token_ids, result.logprobs)]

    def sample_speculative(self, logits: torch.Tensor, items: list[ScheduledSequence]) -> list[SampledTokens]:
        """Sequences without drafts sample as usual; the others go through the rejection sampler.

        Row j of a speculating sequence is sampled as if drafts[:j] were already its output,
        so penalties and min_tokens see exactly what they would have seen one token at a time.
        """
        logits = logits.cpu()  # the rejection sampler's indices and generators are the host's
        if all(_bare_greedy(it.seq) for it in items):
            # What the rejection sampler comes to for these rows (no penalties, bans or logprobs
            # to apply): each row's argmax, drafts kept while they match. At batch 1 its
            # metadata cost more than the comparison (a few percent of a speculative step).
            targets = greedy(logits).tolist()
            results, start = [], 0
            for it in items:
                k = len(it.spec_token_ids)
                tokens = verify_greedy(targets[start:start + k + 1], it.spec_token_ids)
                results.append(SampledTokens(it.seq, tokens, None, k, len(tokens) - 1))
                start += k + 1
            return results
        starts = np.cumsum([0] + [len(it.spec_token_ids) + 1 for it in items])
        plain = [i for i, it in enumerate(items) if not it.spec_token_ids]
        spec = [i for i, it in enumerate(items) if it.spec_token_ids]
        results: list[SampledTokens | None] = [None] * len(items)
        if plain:
            for i, r in zip(plain, self.sample(logits[torch.from_numpy(starts[plain])], [items[i].seq for i in plain])):
                results[i] = r
        rows = torch.from_numpy(np.concatenate([np.arange(starts[i], starts[i + 1]) for i in spec]))
        seqs, outputs, drafts = [], [], []
        for i in spec:
            seq, d = items[i].seq, items[i].spec_token_ids
            drafts.append(d)
            # Only penalties, bad_words and an unmet min_tokens read the output; otherwise no per-row copies.
            history = seq.params.reads_output or seq.params.min_tokens > len(seq.output_token_ids)
            for j in range(len(d) + 1):
                seqs.append(seq)
                outputs.append(seq.output_token_ids + d[:j] if history else seq.output_token_ids)
        meta = self._sampling_metadata(seqs, outputs, logits.shape[-1])
        verified = self.rejection_sampler(logits[rows], meta, drafts, [items[i].seq.generator for i in spec],
                                          [items[i].spec_draft_probs for i in spec])
        for i, v in zip(spec, verified):
            results[i] = SampledTokens(items[i].seq, v.token_ids, v.logprobs, v.num_draft_tokens, v.num_accepted_tokens)
        return results

    def _sampling_metadata(self, seqs: list[Sequence], outputs: list[list[int]], vocab_size: int) -> SamplingMetadata:
        return SamplingMetadata.build(
            params=[s.params for s in seqs],
            prompt_token_ids=[s.prompt_token_ids for s in seqs],
            output_token_ids=outputs,
            generators=[s.generator for s in seqs],
            eos_token_ids=self.eos_token_ids,
            vocab_size=vocab_size,
            bad_words_token_ids=[s.bad_words_token_ids for s in seqs],
        )


def _bare_greedy(seq: Sequence) -> bool:
    """Greedy with nothing to apply before the argmax: no penalties or logit edits, no min_tokens
    still due, no logprobs, no grammar."""
    p = seq.params
    return (p.is_greedy and not p.edits_logits and p.logprobs is None and seq.grammar_state is None
            and p.min_tokens <= len(seq.output_token_ids))
