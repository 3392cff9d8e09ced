"""When and how much to speculate, and what it earned.

Before each step the engine hands the `Speculator` its running sequences. Every sequence
that is decoding (all its tokens but the last have K/V) may get draft tokens in
`seq.spec_token_ids`; the scheduler then counts them in the token budget and the runner
verifies them in the same flat batch as everything else.

Two rules keep speculation from costing more than it earns:
  - batch size: with more than `disable_by_batch_size` unfinished requests, nobody speculates.
    A batch that large keeps the matrix units busy on its own, and each verified guess
    costs as much compute as a real token, so wrong guesses slow everyone down.
  - acceptance: a sequence whose last `WINDOW` speculative steps accepted fewer than
    `min_mean_accepted` tokens per step on average pauses for `backoff` steps, doubling
    on each repeat up to `MAX_BACKOFF`, and resets after a good window. A pause ends on its
    own, so a sequence that starts quoting its prompt later gets speculation back.
Draft lengths never overshoot: at most max_tokens - (generated + 1) and never past max_model_len.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.spec_decode.config import SpeculativeConfig
from kvflow.spec_decode.ngram_proposer import NgramProposer

if TYPE_CHECKING:
    from kvflow.engine.sequence import Sequence
    from kvflow.spec_decode.draft_model import DraftModelProposer

WINDOW = 4
FIRST_BACKOFF = 8
MAX_BACKOFF = 64


@dataclass
class SpecDecodeStats:
    """Counters since start-up (Prometheus counters are fed from these)."""

    num_spec_steps: int = 0  # sequence-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculative step: accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else 0.0

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.num_spec_steps += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position += [0] * (num_draft - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def since(self, earlier: "SpecDecodeStats") -> "SpecDecodeStats":
        """What happened after the `earlier` snapshot (a benchmark's timed part, without its warm-up)."""
        before = earlier.accepted_per_position + [0] * (len(self.accepted_per_position) - len(earlier.accepted_per_position))
        return SpecDecodeStats(
            self.num_spec_steps - earlier.num_spec_steps,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            [a - b for a, b in zip(self.accepted_per_position, before)],
        )

    def describe(self) -> str:
        return (f"speculative decoding: {self.num_accepted_tokens}/{self.num_draft_tokens} draft tokens accepted "
                f"({self.acceptance_rate:.1%}), {self.mean_accepted_length:.2f} tokens per speculative step "
                f"over {self.num_spec_steps} steps")


@dataclass
class _SequenceState:
    recent: list[int] = field(default_factory=list)  # accepted tokens of the last WINDOW spec steps
    paused_steps: int = 0
    backoff: int = FIRST_BACKOFF


class Speculator:
    """`draft` is the draft-model proposer for method "draft_model" (built by the engine, which
    owns model loading); the n-gram proposer needs nothing."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: "DraftModelProposer | None" = None) -> None:
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError(f"speculative_config.method: {config.method!r} and the proposer given disagree")
        self.config = config
        self.max_model_len = max_model_len
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.draft = draft
        self.stats = SpecDecodeStats()
        self._state: dict[str, _SequenceState] = {}

    def propose(self, running: list["Sequence"], num_unfinished: int) -> None:
        """Set `spec_token_ids` on the decoding sequences that should speculate this step."""
        for seq in running:  # drafts the scheduler had no room for last step are not reused
            seq.spec_token_ids, seq.spec_draft_probs = [], None
        limit = self.config.disable_by_batch_size
        if limit is not None and num_unfinished > limit:
            return
        chosen, ks = [], []
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens != 1 or seq.pooling is not None:
                continue  # still prefilling (or recomputing after preemption), or an embedding: nothing to draft
            k = self._max_drafts(seq)
            state = self._state.setdefault(seq.request_id, _SequenceState())
            if k < 1:
                continue
            if state.paused_steps > 0:
                state.paused_steps -= 1
                continue
            chosen.append(seq)
            ks.append(k)
        if self.draft is None:
            for seq, k in zip(chosen, ks):
                seq.spec_token_ids = self.ngram.propose(seq.all_token_ids, k)
        elif chosen:
            for seq, proposal in zip(chosen, self.draft.propose(chosen, ks)):
                seq.spec_token_ids, seq.spec_draft_probs = proposal.token_ids, proposal.probs

    def _max_drafts(self, seq: "Sequence") -> int:
        k = self.config.num_speculative_tokens
        max_tokens = seq.params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - len(seq.output_token_ids) - 1)
        # The last draft's K/V goes to position num_tokens - 1 + k, which must be < max_model_len;
        # one less still emits as many tokens (d_k itself reaches max_model_len and ends the sequence).
        return min(k, self.max_model_len - seq.num_tokens - 1)

    def record(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """Account one verified step of a sequence and update its pause state."""
        if num_draft == 0:
            return
        self.stats.record(num_draft, num_accepted)
        state = self._state.setdefault(request_id, _SequenceState())
        state.recent.append(num_accepted)
        if len(state.recent) < WINDOW:
            return
        if sum(state.recent) / WINDOW < self.config.min_mean_accepted:
            state.paused_steps = state.backoff
            state.backoff = min(2 * state.backoff, MAX_BACKOFF)
        else:
            state.backoff = FIRST_BACKOFF
        state.recent.clear()

    def preempted(self, seqs: list["Sequence"]) -> None:
        """A preempted sequence waits without running: its draft-model KV goes back to the draft's pool."""
        if self.draft is not None:
            for seq in seqs:
                self.draft.forget(seq.request_id)

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)
        if self.draft is not None:
            self.draft.forget(request_id)
