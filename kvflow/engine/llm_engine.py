"""The engine loop: requests in, one step at a time, outputs out.

`LLMEngine.step()` is the whole story of a token:
  speculator.propose()      (speculative decoding only) draft tokens for decoding sequences
  scheduler.schedule()      which sequences run, how many tokens each (token budget)
  runner.execute()          flat tensors -> model -> logits of the completing rows -> sampler
                            (or the rejection sampler, for rows carrying drafts); prompt
                            logprobs of the chunks of requests that asked, appended at once
  _append_tokens()          detokenize, check stop conditions token by token (stop_checker.py)
  scheduler.update_after_step()   num_computed_tokens advanced past the kept tokens, rejected
                            drafts' blocks freed, full blocks published for reuse
  scheduler.finish()        retire the sequences that stopped
The server and `LLM` both drive it through add_request / step / abort_request. Under pipeline
parallelism a step submits up to P batches and applies the oldest (engine/batch_queue.py).
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from typing import Callable

from kvflow.config import INT64_MAX, INT64_MIN, EngineConfig, ModelConfig, is_int, resolve_dtype, resolve_max_model_len
from kvflow.engine.batch_queue import BatchQueue
from kvflow.engine.cpu_threads import set_compute_threads
from kvflow.engine.inputs import (PromptInput, cache_salt_of, check_prompt, load_tokenizer_or_none, tokenize_prompt,
                                  truncate_prompt)
from kvflow.engine.kv_cache_manager import KVCacheManager, chain_root
from kvflow.engine.memory_plan import KVCachePlan
from kvflow.engine.model_placement import (build_lora_manager, build_runner, build_speculator, place_model,
                                           plan_draft_model)
from kvflow.engine.model_runner import SampledTokens, StepOutput
from kvflow.engine.parallel_sampling import SampleGroups, check_n, prompt_tokens_computed
from kvflow.engine.request_state import EngineStats, RequestState, make_output, make_pooling_output
from kvflow.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvflow.engine.sequence import Sequence, SequenceStatus
from kvflow.engine.step_shape import StepShape, step_shape
from kvflow.engine.stop_checker import check_stop
from kvflow.loader import load_model_config, resolve_model_path
from kvflow.loader.generation_config import SamplingDefaults, load_sampling_defaults
from kvflow.lora.request import LoRARequest
from kvflow.outputs import Logprob, PoolingRequestOutput, RequestOutput
from kvflow.pooling.params import PoolingParams
from kvflow.pooling.pooler import PooledOutput, PoolingState
from kvflow.sampling.detokenizer import CompletionText, decode_token, name_tokens
from kvflow.sampling.logits_processors import bad_words_token_ids
from kvflow.sampling.params import SamplingParams
from kvflow.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("kvflow")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        set_compute_threads(config.num_threads)
        start = time.perf_counter()
        path = resolve_model_path(config.model)
        self.model_path = path
        self.model_config: ModelConfig = load_model_config(path)
        self.max_model_len = resolve_max_model_len(self.model_config, config.max_model_len)
        self.dtype = resolve_dtype(config.dtype, self.model_config)
        # Filled in by LLM, the server and the CLI for the fields a request leaves unset; the
        # engine itself runs every request's SamplingParams exactly as given.
        self.sampling_defaults: SamplingDefaults = load_sampling_defaults(path, config.generation_config)
        draft = plan_draft_model(config, path, self.model_config, self.max_model_len)
        placement = place_model(config, path, self.model_config, self.dtype, self.max_model_len,
                                draft.config if draft else None, draft is not None and draft.shares_kv)
        self.device, self.quantization, self.parallel = placement.device, placement.quantization, placement.parallel
        self.distributed = placement.distributed
        self.plan: KVCachePlan = placement.plan
        self.tokenizer = load_tokenizer_or_none(config.tokenizer or path)
        # Each logprob's decoded_token; logprobs repeat tokens, so names are cached.
        self._decode_token = functools.lru_cache(maxsize=1 << 16)(functools.partial(decode_token, self.tokenizer))
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None and eos not in self.eos_token_ids:
            self.eos_token_ids.append(eos)
        self.kv_cache_manager = KVCacheManager(self.plan.num_blocks, config.block_size, config.enable_prefix_caching)
        lora_config = config.lora_config
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                            max_loras=lora_config.max_loras if lora_config else None),
            self.kv_cache_manager,
        )
        self.runner = build_runner(placement, config, self.model_config, self.kv_cache_manager, self.dtype,
                                   self.eos_token_ids, self.max_model_len)
        self.lora = build_lora_manager(config, placement, self.runner) if lora_config else None
        self.speculator = build_speculator(config, draft, placement, self.runner, self.tokenizer, self.dtype,
                                           self.eos_token_ids, self.max_model_len)
        # P > 1: P batches in flight; one at a time with drafts (they are proposed from tokens not yet back)
        self.batch_queue = BatchQueue(self.scheduler, self.runner, self.parallel.pipeline_parallel_size) if (
            self.distributed and self.parallel.pipeline_parallel_size > 1 and self.speculator is None) else None
        # Compiled grammars (cached) for structured output; xgrammar loads on the first such request.
        self.structured_output = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                         self.eos_token_ids)
        self._requests: dict[str, RequestState] = {}  # by sequence id (a sample's own id when n > 1)
        self.sample_groups = SampleGroups()  # requests with n > 1, by request id
        self.prompt_tokens_total = 0  # prompts of requests that produced a first token
        self.generation_tokens_total = 0
        self.computed_tokens_total = 0  # every token that went through the model (prefix hits excluded)
        self.prefill_tokens_total = 0  # prompt positions among them
        # Set to a list to have every step's shape appended (bench throughput's roofline floor).
        self.step_shapes: list[StepShape] | None = None
        logger.info(
            "kvflow: loaded %s (%s) in %.1f s\n%s\n%s",
            path, self.model_config.architecture, time.perf_counter() - start, self.plan.describe(),
            self.sampling_defaults.describe(),
        )
        if self.speculator is not None:
            logger.info("kvflow: %s", config.speculative_config.describe())

    # ---- requests ----------------------------------------------------------------------
    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; ValueError naming the field when something in it cannot be served
        (`lora_request`: an adapter that does not load or fit the model is refused here).
        `PoolingParams` make it an embedding request: its prompt is pooled into one vector
        (`PoolingRequestOutput`, kvflow/pooling) and nothing is generated."""
        if request_id in self._requests or request_id in self.sample_groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if not is_int(priority) or not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}")
        pooling = None
        if isinstance(params, PoolingParams):
            cfg = self.model_config
            params.check(cfg.hidden_size, cfg.is_matryoshka, cfg.matryoshka_dimensions)
            if self.distributed:
                raise ValueError(f"embeddings: not supported with the distributed executor ({self.parallel.describe()}) yet")
            pooling = PoolingState(params, self.config.pooler_config)
            params = SamplingParams(max_tokens=1, detokenize=False,  # never sampled: the prompt is all it runs
                                    truncate_prompt_tokens=params.truncate_prompt_tokens)
        params = params or SamplingParams()
        text, token_ids = truncate_prompt(*self.tokenize(prompt), params.truncate_prompt_tokens, self.max_model_len)
        hash_root = chain_root(lora_request.cache_key if lora_request is not None else None, cache_salt_of(prompt))
        vocab = self.model_config.vocab_size
        check_prompt(token_ids, vocab, self.max_model_len, generates=pooling is None)
        params.check_token_ids(vocab, self.eos_token_ids)
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words)
        if params.prompt_logprobs is not None and self.distributed:
            raise ValueError(f"prompt_logprobs: not supported with the distributed executor ({self.parallel.describe()}) yet")
        arrival_time = arrival_time or time.time()
        if params.structured_outputs is not None:  # compiled now unless already cached (see compile_structured_output)
            self.structured_output.check_servable(params.structured_outputs, self.speculator is not None)
        check_n(params.n, self.config.max_num_seqs)
        if lora_request is not None:  # last: a request refused above leaves no adapter loaded
            self.add_lora(lora_request)

        def make(seq_id: str, p: SamplingParams, index: int = 0) -> RequestState:
            seq = Sequence(seq_id, token_ids, p, arrival_time=arrival_time, priority=priority, prompt=text,
                           bad_words_token_ids=bad_words, lora_request=lora_request, hash_root=hash_root,
                           pooling=pooling)
            if p.structured_outputs is not None:  # every sample walks the grammar on its own
                seq.grammar_state = self.structured_output.new_state(p.structured_outputs)
            # detokenize=False (the engine core of a split server): the API process makes the text.
            tokenizer = self.tokenizer if p.detokenize else None
            output = CompletionText(tokenizer, token_ids, p.skip_special_tokens, p.stop, p.include_stop_str_in_output)
            return RequestState(seq, output, index=index)

        if params.n > 1:  # parallel sampling: k sequences over one prompt (engine/parallel_sampling.py)
            self.sample_groups.add_request(request_id, params, make, self._requests, self.scheduler,
                                           self.config.max_num_seqs)
            return
        req = self._requests[request_id] = make(request_id, params)
        self.scheduler.add(req.seq)

    # ---- LoRA adapters (vLLM's names) ------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (a request naming it loads it too); ValueError when it cannot serve."""
        if self.lora is None:
            raise ValueError("lora_request: this engine serves no LoRA adapters; start it with enable_lora=True "
                             "(kvflow serve --enable-lora)")
        self.lora.add_adapter(lora_request, {r.seq.lora_int_id for r in self._requests.values()})
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter no request uses; False when it is not loaded or still in use."""
        in_use = any(r.seq.lora_int_id == lora_int_id for r in self._requests.values())
        return self.lora is not None and not in_use and self.lora.remove_adapter(lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self.lora.adapters) if self.lora is not None else set()

    def compile_structured_output(self, params: SamplingParams) -> None:
        """Compile `params`' output constraint into the grammar cache; StructuredOutputError if it cannot be served.

        Thread-safe, and meant to be called off the engine thread (the async engine does) so that
        `add_request` finds the grammar compiled and other requests' steps never wait for it.
        """
        if params.structured_outputs is not None:
            self.structured_output.check_servable(params.structured_outputs, self.speculator is not None)
            self.structured_output.compile(params.structured_outputs)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request (every sample of it) and free its blocks now. Returns False if it was not running."""
        req = self._requests.get(request_id)
        group = self.sample_groups.pop(req.group.request_id if req and req.group else request_id)
        if group is not None:
            return any([self._abort_sequence(r.seq.request_id) for r in group.samples])
        return self._abort_sequence(request_id)

    def abort_sample(self, request_id: str, index: int) -> bool:
        """Stop sample `index` of a request with n > 1 and free its blocks now; the others go on (the
        split server's API process matches stop strings, so it asks when one ends a sample)."""
        return self.sample_groups.abort_sample(request_id, index, self._abort_sequence)

    def _abort_sequence(self, request_id: str) -> bool:
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req.seq, SequenceStatus.FINISHED_ABORTED)
        if self.speculator is not None:
            self.speculator.forget(request_id)
        return True

    def has_request(self, request_id: str) -> bool:
        """Whether a request is still known to the engine (waiting or running)."""
        return request_id in self._requests or request_id in self.sample_groups

    def running_request_ids(self) -> list[str]:
        """The requests in the running batch, by the ids they were added with (n > 1: once)."""
        return self.sample_groups.request_ids(self.scheduler.running, self._requests)

    def num_waiting_requests(self) -> int:
        """Requests in the waiting queue, a request with n > 1 counted once (its samples queue
        separately once its prompt is computed)."""
        return len(self.sample_groups.request_ids(self.scheduler.waiting, self._requests))

    def num_waiting_for_a_slot(self) -> int:
        """Waiting requests beyond the slots the next step fills (Scheduler.free_slots): the server's
        measure of overload. A burst into an idle engine waits only until that step."""
        return max(0, self.num_waiting_requests() - self.scheduler.free_slots())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or (self.batch_queue is not None and self.batch_queue.busy)

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one scheduled batch; return an output for every request that got tokens, and
        for every embedding request whose prompt it completed."""
        if self.batch_queue is not None:
            return self._pipelined_step()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, len(self.scheduler.running) + len(self.scheduler.waiting))
        sched = self.scheduler.schedule()
        if self.speculator is not None and sched.preempted:
            self.speculator.preempted(sched.preempted)
        if sched.is_empty:
            return []
        return self._apply(sched, self.runner.execute(sched))

    def _pipelined_step(self) -> list[RequestOutput]:
        """P > 1: keep up to P batches in flight (engine/batch_queue.py), apply the oldest."""
        self.batch_queue.fill()
        done = self.batch_queue.pop()
        return self._apply(*done) if done is not None else []

    def _apply(self, sched: SchedulerOutput, result: StepOutput) -> list[RequestOutput | PoolingRequestOutput]:
        """A batch's tokens into its requests: append, stop checks, scheduler bookkeeping, outputs."""
        self.prefill_tokens_total += prompt_tokens_computed(sched)  # before num_computed_tokens moves on
        if self.step_shapes is not None:
            self.step_shapes.append(step_shape(sched))
        for entries in result.prompt_logprobs:  # before the outputs, which carry them
            entries.append_to_sequence(self._token_namer(entries.seq))
        sampled, pooled = result.sampled, result.pooled
        now = time.time()
        advanced: list[RequestState] = []
        stopped: list[tuple[RequestState, SequenceStatus]] = []
        num_rejected: dict[str, int] = {}
        for result in sampled:
            if result.num_draft_tokens:
                num_rejected[result.seq.request_id] = result.num_rejected_tokens
            req = self._requests.get(result.seq.request_id)
            if req is None:
                continue
            status = self._append_tokens(req, result, now)
            advanced.append(req)
            if status is not None:
                stopped.append((req, status))
            if result.num_draft_tokens and self.speculator is not None:
                # Drafts kept past a stop (EOS, stop string, max_tokens) were dropped: not counted as accepted.
                kept = min(result.num_accepted_tokens, len(req.new_token_ids) - 1)
                self.speculator.record(result.seq.request_id, result.num_draft_tokens, kept)
        # After the append, so that blocks completed by accepted drafts hash the right tokens;
        # before finishing, so that a finished sequence's last full blocks are still published.
        self.scheduler.update_after_step(sched, num_rejected)
        self.sample_groups.release_ready(self.scheduler)  # samples whose request's prompt is now computed
        self.computed_tokens_total += sched.num_batched_tokens  # rejected drafts included: they cost compute
        for req, status in stopped:
            self.scheduler.finish(req.seq, status)
            if self.speculator is not None:
                self.speculator.forget(req.seq.request_id)
        outputs = self.sample_groups.outputs(advanced, make_output) + [self._finish_pooled(p, now) for p in pooled
                                                                          if self._owns(p.seq)]
        for req, _ in stopped:
            del self._requests[req.seq.request_id]
            if req.group is not None and req.group.finished:
                self.sample_groups.pop(req.group.request_id)
        return outputs

    def _owns(self, seq: Sequence) -> bool:
        """`seq` is still the live sequence of its id (not aborted, its id not reused since)."""
        req = self._requests.get(seq.request_id)
        return req is not None and req.seq is seq

    def _finish_pooled(self, pooled: PooledOutput, now: float) -> PoolingRequestOutput:
        """An embedding request's prompt is computed: retire it (its blocks stay in the prefix cache)."""
        seq = pooled.seq
        del self._requests[seq.request_id]
        seq.first_token_time = now
        self.prompt_tokens_total += seq.num_prompt_tokens
        self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        return make_pooling_output(seq, pooled.data)

    def _append_tokens(self, req: RequestState, result: SampledTokens, now: float) -> SequenceStatus | None:
        """Append the step's tokens one by one until a stop condition; return the finish status, if any.

        Tokens after the one that stops the sequence (an accepted draft past EOS, a stop
        string or max_tokens) are dropped, as if they had never been generated.
        """
        seq = req.seq
        seq.last_token_time = now
        if seq.first_token_time is None:
            seq.first_token_time = now
            if req.index == 0:  # a prompt counts once, however many samples it has
                self.prompt_tokens_total += seq.num_prompt_tokens
        prev_len = len(req.output.text)
        req.new_token_ids = []
        status = None
        for i, tid in enumerate(result.token_ids):
            status = self._append_token(req, tid, result.logprobs[i] if result.logprobs is not None else None)
            if status is not None:
                break
        text = req.output.text
        req.new_text = text[prev_len:] if len(text) >= prev_len else ""
        return status

    def _token_namer(self, seq: Sequence) -> Callable[[int], str] | None:
        """What names a request's logprob tokens: None when it asked for no text (a split server's core)."""
        return self._decode_token if seq.params.detokenize and self.tokenizer is not None else None

    def _append_token(self, req: RequestState, tid: int, logprobs: dict[int, Logprob] | None) -> SequenceStatus | None:
        seq = req.seq
        seq.output_token_ids.append(tid)
        req.new_token_ids.append(tid)
        self.generation_tokens_total += 1
        if logprobs is not None:
            if (decode := self._token_namer(seq)) is not None:
                name_tokens([logprobs], decode)
            seq.output_logprobs.append(logprobs)
            req.cumulative_logprob += logprobs[tid].logprob  # the sampler always reports the sampled token
        return check_stop(req, tid, self.eos_token_ids, self.max_model_len)

    # ---- observability -----------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.num_blocks,
            prefix_cache_queries=kv.prefix_stats.queries,
            prefix_cache_hits=kv.prefix_stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens_total,
            generation_tokens=self.generation_tokens_total,
            computed_tokens=self.computed_tokens_total,
            prefill_tokens=self.prefill_tokens_total,
            spec_decode=copy.deepcopy(self.speculator.stats) if self.speculator is not None else None,
        )

    def shutdown(self) -> None:
        """Stop the worker processes of a distributed engine (nothing to do in one process)."""
        if self.distributed:
            self.distributed.executor.shutdown()

    def check_integrity(self) -> None:
        self.kv_cache_manager.check_integrity()
