"""The driver's runner: the scheduler's output in, sampled tokens out, the model elsewhere.

It is the engine's `ModelRunner` without a model or a KV pool: it flattens the scheduled
batch exactly as the single-process runner does (`prepare_inputs`, against the driver's block
tables), hands the flat batch to the executor as one `StepMessage`, and samples the logits
that come back with the same sampler code. When every sampled row is a bare greedy pick (no
penalties, bans, logprobs, grammar or drafts) the output rank takes the argmax itself and
only token ids cross back.
"""

from __future__ import annotations

import torch

from kvflow.config import ModelConfig
from kvflow.distributed.executor import Executor
from kvflow.distributed.messages import StepMessage
from kvflow.engine.kv_cache_manager import KVCacheManager
from kvflow.engine.model_runner import ModelRunner, SampledTokens, StepOutput
from kvflow.engine.scheduler import SchedulerOutput
from kvflow.sampling.sampler import Sampler
from kvflow.spec_decode.rejection_sampler import RejectionSampler


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
        inputs = self.prepare_inputs(out)
        seqs = [it.seq for it in inputs.sampled]
        argmax_only = bool(seqs) and not any(it.spec_token_ids for it in inputs.sampled) and not any(
            s.grammar_state is not None for s in seqs) and self._sampling_metadata(
            seqs, [s.output_token_ids for s in seqs], self.model_config.vocab_size).all_greedy
        result = self.executor.execute(StepMessage.from_model_input(inputs, argmax_only))
        if not seqs:
            return StepOutput([], [])
        if argmax_only:
            return StepOutput([SampledTokens(s, [t], None) for s, t in zip(seqs, result.token_ids)], [])
        if not any(it.spec_token_ids for it in inputs.sampled):
            return StepOutput(self.sample(result.logits, seqs), [])
        return StepOutput(self.sample_speculative(result.logits, inputs.sampled), [])

    def shutdown(self) -> None:
        self.executor.shutdown()
