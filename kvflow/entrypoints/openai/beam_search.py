"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: `n` beams per prompt.

The search is `kvflow.sampling.beam_search.BeamSearch`, driven here through the server's engine
(in-process or split): each step submits one one-token request per live beam of every prompt,
all at once, and waits for them; a client that leaves aborts them. The response has `n`
choices per prompt, best first. `max_tokens`, `ignore_eos`, `include_stop_str_in_output`,
`length_penalty` and `temperature` (0 unless given: a deterministic search) apply; what beam
search cannot honour (streaming, logprobs, structured output, tools, stop strings and stop
tokens, echo, min_tokens, logit edits, penalties, top-p/k and min-p, a seed with temperature > 0,
disaggregation) is refused by name rather than ignored.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from kvflow.entrypoints.openai import choices as c
from kvflow.entrypoints.openai import protocol as p
from kvflow.sampling.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, advance_all, pending_beams

if TYPE_CHECKING:
    from kvflow.entrypoints.openai.server import OpenAIServer


_NEUTRAL: dict[str, tuple] = {  # sampling fields beam search accepts only at their no-op values
    "stop_token_ids": (None, []), "logit_bias": (None, {}), "allowed_token_ids": (None,), "bad_words": (None, []),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "top_p": (None, 1), "top_k": (None, 0, -1), "min_p": (None, 0),
}


def beam_search_params(body: p.SamplingRequest, prompt_len: int, max_model_len: int) -> BeamSearchParams:
    """The request's beam search, or a 400 naming the field it cannot honour."""
    refused = {"stream": bool(body.stream), "logprobs": body.requested_logprobs() is not None,
               "prompt_logprobs": body.prompt_logprobs is not None, "stop": bool(body.stop),
               "echo": bool(getattr(body, "echo", False)), "tools": bool(getattr(body, "tools", None)),
               "kv_transfer_params": body.kv_transfer_params is not None, "min_tokens": body.min_tokens > 0,
               body.structured_output_field or "structured_outputs": body.structured_output_field is not None}
    temperature = body.temperature if body.temperature is not None else 0.0
    # Logit edits, penalties and truncations would change the candidates; the search does not apply them.
    for name, neutral in _NEUTRAL.items():
        refused[name] = getattr(body, name) not in neutral
    refused["seed"] = body.seed is not None and temperature > 0  # the steps' sampled tokens are not seeded
    for name, value in refused.items():
        if value:
            raise p.InvalidRequestError(f"{name}: not supported with use_beam_search", param=name)
    params = body.to_sampling_params(prompt_len, max_model_len)  # max_tokens fitted to the context, n checked
    try:
        return BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens, ignore_eos=body.ignore_eos,
                                temperature=temperature, length_penalty=body.length_penalty,
                                include_stop_str_in_output=body.include_stop_str_in_output)
    except ValueError as exc:
        name = str(exc).split(" ")[0]
        raise p.InvalidRequestError(str(exc).replace("beam_width", "n (the beam width)"),
                                    param="n" if name == "beam_width" else name) from None


async def run_beam_search(server: "OpenAIServer", prompts: list[list[int]], params: list[BeamSearchParams],
                          body: p.SamplingRequest, raw: Request, lora: Any) -> list[BeamSearchOutput]:
    engine = server.engine
    searches = [BeamSearch(ids, bp, engine.eos_token_ids, engine.max_model_len, lora) for ids, bp in zip(prompts, params)]
    while pending := pending_beams(searches):
        _, streams = await c.submit_all(engine, "beam", [(None, beam.tokens) for _, beam in pending],
                                        [s.step_params() for s, _ in pending], body, lora)
        outs = await c.gather_all([server.final_output(stream, raw) for stream in streams], streams)
        advance_all(pending, [out.outputs[0].logprobs[0] for out in outs])
    return [s.result(engine.tokenizer) for s in searches]


def _usage(prompts: list[list[int]], results: list[BeamSearchOutput]) -> p.UsageInfo:
    generated = sum(len(seq.tokens) - len(ids) for ids, r in zip(prompts, results) for seq in r.sequences)
    return p.UsageInfo.of(sum(len(ids) for ids in prompts), generated)


async def completion(server: "OpenAIServer", body: p.CompletionRequest, raw: Request, lora: Any,
                     model: str) -> Response:
    prompts = await asyncio.to_thread(lambda: [server.tokenize_prompt(prompt, body.truncate_prompt_tokens)[1]
                                               for prompt in c.prompt_list(body.prompt)])
    params = [beam_search_params(body, len(ids), server.engine.max_model_len) for ids in prompts]
    width = params[0].beam_width
    c.check_best_of(body.best_of, width)
    results = await run_beam_search(server, prompts, params, body, raw, lora)
    choices = [p.CompletionResponseChoice(index=i * width + j, text=seq.text or "", logprobs=None,
                                          finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
               for i, r in enumerate(results) for j, seq in enumerate(r.sequences)]
    resp = p.CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                                choices=choices, usage=_usage(prompts, results))
    return Response(resp.model_dump_json(), media_type="application/json")


async def chat(server: "OpenAIServer", body: p.ChatCompletionRequest, raw: Request, lora: Any,
               model: str) -> Response:
    _, ids = await asyncio.to_thread(server.chat_prompt, body)
    params = beam_search_params(body, len(ids), server.engine.max_model_len)
    result, = await run_beam_search(server, [ids], [params], body, raw, lora)
    choices = [p.ChatChoice(index=j, message=p.ChatResponseMessage(content=seq.text or ""),
                            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
               for j, seq in enumerate(result.sequences)]
    resp = p.ChatCompletionResponse(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                                    choices=choices, usage=_usage([ids], [result]))
    return Response(resp.model_dump_json(), media_type="application/json")
