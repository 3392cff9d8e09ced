"""The pipeline's batch queue with the scheduler tests' fake model (no weights, no processes).

The fake runner computes a batch when it is submitted (a pipeline's stages write a batch's K/V
in submission order) and hands its tokens back only at `collect`, so the scheduler forms the
next batches while earlier ones are in flight. The fake model derives every K/V entry from
the one before it as read back from the cache, so a block handed out wrongly while a batch is
in flight, a sequence scheduled before its token is back, or a preempted in-flight sequence
changes the tokens.
"""

from __future__ import annotations

import pytest

from kvflow.engine.batch_queue import BatchQueue
from kvflow.engine.model_runner import SampledTokens, StepOutput
from kvflow.engine.sequence import SequenceStatus
from tests.engine.scheduler_harness import Harness, expected_outputs, load


class FakePipelineRunner:
    def __init__(self, h: Harness) -> None:
        self.h, self.replies = h, []

    def submit(self, out):
        assert not any(it.seq.status.is_finished for it in out.scheduled)
        return self.h.model.execute(out)

    def collect(self, sampled) -> StepOutput:
        return StepOutput([SampledTokens(seq, [token], None) for seq, token in sampled], [])


def _run(h: Harness, depth: int, abort_at: int | None = None) -> tuple[BatchQueue, str | None]:
    """Drive the queue as LLMEngine._pipelined_step does; abort one in-flight sequence at step `abort_at`."""
    queue, aborted = BatchQueue(h.sched, FakePipelineRunner(h), depth), None
    steps = 0
    while h.sched.has_unfinished() or queue.busy:
        assert steps < 10_000, "the queue stopped making progress"
        queue.fill()
        in_flight = queue.in_flight_sequences()
        assert len(in_flight) == len(set(in_flight)), "a sequence in two batches in flight"
        if abort_at is not None and steps == abort_at and aborted is None:
            victims = [s for s in in_flight if s.output_token_ids]
            if victims:
                aborted = victims[-1].request_id
                h.sched.finish(victims[-1], SequenceStatus.FINISHED_ABORTED)
        sched, result = queue.pop()
        h.sched.update_after_step(sched)
        for r in result.sampled:
            seq = r.seq
            assert seq.num_computed_tokens == seq.num_tokens
            seq.output_token_ids += r.token_ids
            if seq.num_tokens >= h.targets[seq.request_id]:
                h.sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        h.kv.check_integrity()
        steps += 1
    assert h.kv.num_free_blocks == h.kv.num_blocks
    return queue, aborted


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("num_blocks", [64, 12], ids=["roomy", "preempting"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix", "no-prefix"])
def test_batches_in_flight_give_the_reference_tokens(depth, num_blocks, prefix_caching):
    h = Harness(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=prefix_caching)
    load(h)
    queue, _ = _run(h, depth)
    assert h.outputs() == expected_outputs()
    assert queue.peak_in_flight == depth
    if num_blocks == 12:
        assert h.sched.num_preemptions > 0, "the small pool was meant to preempt"


def test_each_batch_takes_its_share_of_the_sequences():
    """Four decoding sequences, two stages: two batches of two, not one of four and an empty one."""
    h = Harness(num_blocks=64, block_size=4)
    for i in range(4):
        h.add(f"r{i}", [1 + i, 2, 3], 12)
    queue = BatchQueue(h.sched, FakePipelineRunner(h), 2)
    queue.fill()
    assert queue.num_in_flight == 2
    assert [len(b.sched.scheduled) for b in queue._batches] == [2, 2]


def test_a_sequence_aborted_in_flight_is_dropped_and_the_rest_is_exact():
    h = Harness(num_blocks=16, block_size=4, max_num_batched_tokens=16)
    load(h)
    _, aborted = _run(h, 2, abort_at=6)
    assert aborted is not None
    expected = expected_outputs()
    outputs = h.outputs()
    assert outputs[aborted] == expected[aborted][: len(outputs[aborted])]
    assert len(outputs[aborted]) < len(expected[aborted])
    assert {k: v for k, v in outputs.items() if k != aborted} == {k: v for k, v in expected.items() if k != aborted}


def test_an_interrupted_wait_leaves_the_batch_first_in_line():
    """Ctrl-C while waiting for a reply: the next pop still answers that batch, not the one after."""
    h = Harness(num_blocks=64, block_size=4)
    for i in range(4):
        h.add(f"r{i}", [1 + i, 2, 3], 12)
    runner = FakePipelineRunner(h)
    queue = BatchQueue(h.sched, runner, 2)
    queue.fill()
    first = [it.seq for it in queue._batches[0].sched.scheduled]
    collect, calls = runner.collect, []

    def interrupted_once(pending):
        calls.append(pending)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return collect(pending)

    runner.collect = interrupted_once
    with pytest.raises(KeyboardInterrupt):
        queue.pop()
    assert queue.num_in_flight == 2 and set(first) <= set(queue.in_flight_sequences())
    sched, result = queue.pop()
    assert [it.seq for it in sched.scheduled] == first == [r.seq for r in result.sampled]


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth"):
        BatchQueue(Harness().sched, None, 0)

