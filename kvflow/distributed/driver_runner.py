"""The driver's runner: the scheduler's output in, sampled tokens out, the model elsewhere.

It is the engine's `ModelRunner` without a model or a KV pool: it flattens the scheduled
batch exactly as the single-process runner does (`prepare_inputs`, against the driver's block
tables), hands the flat batch to the executor as one `StepMessage`, and samples the logits
that come back with the same sampler code. When every sampled row is a bare greedy pick (no
penalties, bans, logprobs, grammar or drafts) the output rank takes the argmax itself and
only token ids cross back. `submit` and `collect` split a step in two, so that a pipeline
keeps several steps in flight (engine/batch_queue.py); `execute` is both, back to back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.config import ModelConfig
from kvflow.distributed.executor import Executor
from kvflow.distributed.messages import StepMessage
from kvflow.engine.kv_cache_manager import KVCacheManager
from kvflow.engine.model_runner import ModelRunner, SampledTokens, StepOutput
from kvflow.engine.scheduler import ScheduledSequence, SchedulerOutput
from kvflow.sampling.sampler import Sampler
from kvflow.spec_decode.rejection_sampler import RejectionSampler


@dataclass
class PendingStep:
    """A step sent and not yet answered: what its reply is sampled for."""

    sampled: list[ScheduledSequence]  # the rows that get a token, in the reply's order
    argmax_only: bool  # the reply is token ids, not logits


class DriverRunner(ModelRunner):
    def __init__(self, executor: Executor, model_config: ModelConfig, kv_cache_manager: KVCacheManager,
                 eos_token_ids: list[int]) -> None:  # no super().__init__: no model, no KV pool here
        self.executor, self.model, self.model_config, self.kv = executor, None, model_config, kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.eos_token_ids = eos_token_ids
        self.kv_caches = []
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepOutput:
        return self.collect(self.submit(out))

    def submit(self, out: SchedulerOutput) -> PendingStep:
        """Flatten the batch and send it; the sampling happens in `collect`, when its logits are back."""
        inputs = self.prepare_inputs(out)
        seqs = [it.seq for it in inputs.sampled]
        argmax_only = bool(seqs) and not any(it.spec_token_ids for it in inputs.sampled) and not any(
            s.grammar_state is not None for s in seqs) and self._sampling_metadata(
            seqs, [s.output_token_ids for s in seqs], self.model_config.vocab_size).all_greedy
        self.executor.submit(StepMessage.from_model_input(inputs, argmax_only))
        return PendingStep(inputs.sampled, argmax_only)

    @torch.inference_mode()
    def collect(self, pending: PendingStep) -> StepOutput:
        """The oldest submitted step's tokens (steps come back in the order they were submitted)."""
        result = self.executor.collect()
        sampled = pending.sampled
        seqs = [it.seq for it in sampled]
        if not seqs:
            return StepOutput([], [])
        if pending.argmax_only:
            return StepOutput([SampledTokens(s, [t], None) for s, t in zip(seqs, result.token_ids)], [])
        if not any(it.spec_token_ids for it in sampled):
            return StepOutput(self.sample(result.logits, seqs), [])
        return StepOutput(self.sample_speculative(result.logits, sampled), [])

    def shutdown(self) -> None:
        self.executor.shutdown()
