"""The scheduler tests' harness: a scheduler, a KV cache manager and the fake model
(fake_model.py), driven like LLMEngine.step(), with a workload whose prompts share prefixes.
Shared by test_scheduler.py, test_scheduler_preemption.py and test_batch_queue.py.
"""

from __future__ import annotations

from kvflow.engine.kv_cache_manager import KVCacheManager
from kvflow.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvflow.engine.sequence import Sequence, SequenceStatus
from kvflow.sampling.params import SamplingParams
from tests.engine import fake_model
from tests.engine.fake_model import FakeModel

VOCAB = 50


def reference_output(prompt: list[int], target_len: int) -> list[int]:
    """What the fake model generates for `prompt` without any cache: the ground truth."""
    return fake_model.reference_output(prompt, target_len, VOCAB)


class Harness:
    """A scheduler, a KV cache manager and the fake model, driven like LLMEngine.step()."""

    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        headroom: int = 0,  # most tests build exact pool states; headroom has its own test
    ) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.sched = Scheduler(
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, admission_headroom_blocks=headroom), self.kv
        )
        self.model = FakeModel(self.kv, VOCAB)
        self.targets: dict[str, int] = {}
        self.seqs: dict[str, Sequence] = {}
        self.num_steps = 0

    def add(self, request_id: str, prompt: list[int], target_len: int, priority: int = 0) -> Sequence:
        assert target_len > len(prompt)
        seq = Sequence(request_id, list(prompt), SamplingParams(), priority=priority)
        self.targets[request_id] = target_len
        self.seqs[request_id] = seq
        self.sched.add(seq)
        return seq

    def step(self) -> tuple[SchedulerOutput, list[Sequence]]:
        out = self.sched.schedule()
        sampled = self.model.execute(out)  # is_sampled is read before the update
        self.sched.update_after_step(out)
        for seq, token in sampled:
            assert seq.num_computed_tokens == seq.num_tokens
            seq.output_token_ids.append(token)
            if seq.num_tokens >= self.targets[seq.request_id]:
                self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        self.kv.check_integrity()
        self.num_steps += 1
        return out, [s for s, _ in sampled]

    def run(self, max_steps: int = 10_000, each=None) -> list[SchedulerOutput]:
        outs = []
        while self.sched.has_unfinished():
            assert len(outs) < max_steps, "the scheduler stopped making progress"
            out, _ = self.step()
            assert not out.is_empty, "an empty step while requests are pending"
            if each is not None:
                each(out)
            outs.append(out)
        assert self.kv.num_free_blocks == self.kv.num_blocks
        return outs

    def outputs(self) -> dict[str, list[int]]:
        return {rid: list(seq.output_token_ids) for rid, seq in self.seqs.items()}


def prompt(start: int, n: int) -> list[int]:
    return [(start + 7 * i) % VOCAB for i in range(n)]


WORKLOAD = [  # (prompt, target length, priority); shared prefixes so the prefix cache is used
    (prompt(0, 13), 20, 0),
    (prompt(0, 13) + [3, 4], 22, 0),
    (prompt(5, 3), 15, 1),
    (prompt(0, 8) + prompt(9, 9), 24, 0),
    (prompt(11, 21), 26, 2),
    (prompt(5, 3), 9, 0),
    (prompt(2, 1), 12, 1),
    (prompt(0, 13), 17, 0),
]


def load(h: Harness, workload=WORKLOAD, use_priority: bool = False) -> None:
    for i, (p, target, prio) in enumerate(workload):
        h.add(f"r{i}", p, target, prio if use_priority else 0)


def expected_outputs(workload=WORKLOAD) -> dict[str, list[int]]:
    return {f"r{i}": reference_output(p, target) for i, (p, target, _) in enumerate(workload)}
