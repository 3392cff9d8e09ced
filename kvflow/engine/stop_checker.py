"""Whether a sequence stops on the token just appended: the engine's order of checks.

The order matters where two conditions meet on one token, and a split server's API process
(`entrypoints/core/assembler.py`) repeats it for the stop strings it matches itself:

1. the token's text is added (a stopping EOS or stop token adds none, unless asked);
2. the grammar: a token it does not allow aborts the request, its end stops it;
3. EOS (unless `ignore_eos`), then a stop token id: "stop", both only past `min_tokens`;
4. a stop string completed by the text ("stop", the text cut at it), past `min_tokens`;
5. `max_tokens`, then `max_model_len`: "length".
"""

from __future__ import annotations

import logging

from kvflow.engine.request_state import RequestState
from kvflow.engine.sequence import SequenceStatus

logger = logging.getLogger("kvflow")


def check_stop(req: RequestState, token_id: int, eos_token_ids: list[int], max_model_len: int) -> SequenceStatus | None:
    """Add `token_id`'s text to the request's output and return its finish status, if it ends here.

    `token_id` must already be the last of `req.seq.output_token_ids`.
    """
    seq, params = req.seq, req.seq.params
    n_out = len(seq.output_token_ids)
    eos = token_id in eos_token_ids and n_out >= params.min_tokens
    stop_token = token_id in params.stop_token_ids and n_out >= params.min_tokens
    ends = stop_token or (eos and (not params.ignore_eos or seq.grammar_state is not None))
    req.output.add_token(token_id, stops=ends)  # a stopping token adds no text (CompletionText.add_token)
    if seq.grammar_state is not None:
        if not seq.grammar_state.accept(token_id):  # the sampler picks allowed tokens only: a broken invariant,
            logger.error("structured output: token %d of request %s is not allowed by its grammar; "
                         "aborting it", token_id, seq.request_id)  # which ends this request, not the batch
            return SequenceStatus.FINISHED_ABORTED
        if seq.grammar_state.is_terminated:  # the grammar is complete (its stop token accepted)
            return SequenceStatus.FINISHED_STOPPED
    if eos and not params.ignore_eos:
        return SequenceStatus.FINISHED_STOPPED
    if stop_token:
        seq.stop_reason = token_id
        return SequenceStatus.FINISHED_STOPPED
    if n_out >= params.min_tokens:
        stop = req.output.find_stop()
        if stop is not None:
            seq.stop_reason = stop
            return SequenceStatus.FINISHED_STOPPED
    if params.max_tokens is not None and n_out >= params.max_tokens:
        return SequenceStatus.FINISHED_LENGTH
    if seq.num_tokens >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH
    return None
