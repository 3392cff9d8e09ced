"""The OpenAI-compatible HTTP server: FastAPI routes over an `AsyncEngine`.

`build_app` wires one engine to one app: /v1/models (the base model and its LoRA adapters,
adapters.py), /v1/completions, /v1/chat/completions (JSON or SSE streaming in OpenAI's chunk
format; beam_search.py for use_beam_search), /v1/embeddings (embeddings.py), /tokenize and
/detokenize (vLLM's), /health, /metrics and /version. Every error leaves in OpenAI's shape
{"error": {message, type, param, code}} with the status an OpenAI client expects, so SDK
exception classes map one to one. A request whose client went away
is aborted in the engine (its KV blocks freed before the next step): streams notice on the
failed write or on a disconnect poll, non-streaming requests on the poll alone.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvflow.engine.inputs import truncate_prompt
from kvflow.entrypoints.async_engine import AsyncEngine, EngineDeadError, EngineStepError, RequestStream
from kvflow.entrypoints.openai import beam_search
from kvflow.entrypoints.openai import choices as c
from kvflow.entrypoints.openai import prompt_ids
from kvflow.entrypoints.openai import protocol as p
from kvflow.entrypoints.openai.adapters import ServedModels, register_adapter_routes, runtime_updating_allowed
from kvflow.entrypoints.openai.auth import APIKeyMiddleware
from kvflow.entrypoints.openai.dashboard import register_dashboard
from kvflow.entrypoints.openai.embeddings import register_embeddings
from kvflow.entrypoints.openai.errors import (ClientDisconnected, add_error_handlers, check_text, error_response,
                                              stream_error_event, structured_output_errors)
from kvflow.entrypoints.openai.lifecycle import DrainMiddleware, DrainState
from kvflow.entrypoints.openai.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware
from kvflow.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs, echo_logprobs, joined, prompt_logprobs
from kvflow.entrypoints.openai.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from kvflow.entrypoints.openai.streaming import TextStreamer, sse, sse_response  # noqa: F401 (TextStreamer: re-exported)
from kvflow.entrypoints.openai.tokenization import register_tokenization
from kvflow.entrypoints.openai.tool_parsers import make_tool_parser
from kvflow.loader.tokenizer import token_bytes
from kvflow.lora.request import LoRARequest
from kvflow.outputs import RequestOutput
from kvflow.sampling.detokenizer import decode_token
from kvflow.sampling.params import SamplingParams

DISCONNECT_POLL_S = 0.25  # how often a request waiting for tokens checks that its client is still there
logger = logging.getLogger("kvflow")


class OpenAIServer:
    """Request handling shared by the routes: validation, submission, collection, formatting."""

    def __init__(self, engine: AsyncEngine, models: ServedModels, metrics: ServerMetrics, tool_parser: Any = None) -> None:
        self.engine, self.models, self.metrics = engine, models, metrics  # models: the base and its adapters
        self.tool_parser = tool_parser  # reads the calls of tool_choice "auto" (tool_parsers.py); None: refused
        self.decode_token = functools.lru_cache(maxsize=1 << 16)(self._decode_token)  # logprobs repeat tokens
        self.token_bytes = functools.lru_cache(maxsize=1 << 16)(self._token_bytes)

    # ---- request preparation -----------------------------------------------------------------
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); a 404 for a name not served."""
        return self.models.resolve(model)

    # Routes call these through asyncio.to_thread (prompt_ids.py says why).
    def tokenize_prompt(self, prompt: str | list[int], keep: int | None = None,
                        bounded: bool = True) -> tuple[str | None, list[int]]:
        """The prompt's ids, as LLMEngine.tokenize makes them (so results match LLM.generate), cut to
        its last `keep` tokens (truncate_prompt_tokens) before anything checks its length."""
        if isinstance(prompt, list):
            return truncate_prompt(None, [int(t) for t in prompt], keep, self.engine.max_model_len)
        if self.engine.tokenizer is None:
            raise p.InvalidRequestError("prompt: this model has no tokenizer; send token ids", param="prompt")
        check_text(prompt, "prompt")
        ids = self.encode(prompt, "prompt", bounded and keep is None)
        return truncate_prompt(prompt, ids, keep, self.engine.max_model_len)

    def encode(self, text: str, param: str, bounded: bool, add_special_tokens: bool = True) -> list[int]:
        return prompt_ids.encode(self.engine.tokenizer, text, param, self.engine.max_model_len, bounded,
                              add_special_tokens)

    def chat_prompt(self, body: p.ChatCompletionRequest, add_special_tokens: bool = False,
                    bounded: bool = True) -> tuple[str | None, list[int]]:
        text = prompt_ids.chat_text(self.engine.tokenizer, body)
        keep = getattr(body, "truncate_prompt_tokens", None)
        ids = self.encode(text, "messages", bounded and keep is None, add_special_tokens)
        return truncate_prompt(text, ids, keep, self.engine.max_model_len)

    def sampling_params(self, body: p.SamplingRequest, prompt_len: int) -> SamplingParams:
        """The request's sampling fields; those it leaves unset take the model's defaults."""
        return body.to_sampling_params(prompt_len, self.engine.max_model_len, self.engine.sampling_defaults.values)

    def _decode_token(self, token_id: int) -> str:
        tok = self.engine.tokenizer
        if tok is None:  # a model without a tokenizer: name tokens by id, as vLLM's token-id mode does
            return f"token_id:{token_id}"
        return decode_token(tok, token_id)

    def _token_bytes(self, token_id: int) -> bytes:
        tok = self.engine.tokenizer
        return self._decode_token(token_id).encode("utf-8") if tok is None else token_bytes(tok, token_id)

    # ---- consuming a request's outputs --------------------------------------------------------
    async def outputs(self, stream: RequestStream, raw: Request) -> AsyncIterator[RequestOutput]:
        """The request's outputs, recorded in the metrics; aborts it if the client leaves.

        One watcher task per request polls for the disconnect, so a token costs one queue read
        here, not a task and a timed wait (that per-token work took CPU from the engine's cores).
        """
        tracker = self.metrics.tracker()
        gone = asyncio.Event()
        watcher = asyncio.create_task(self._watch_client(raw, stream, gone))
        try:
            while (out := await stream.next()) is not None:
                tracker.on_output(out)
                yield out
            if gone.is_set():
                raise ClientDisconnected()
        finally:
            watcher.cancel()
            stream.abort()  # no-op once finished

    @staticmethod
    async def _watch_client(raw: Request, stream: RequestStream, gone: asyncio.Event) -> None:
        """Abort `stream` (which ends its reader) once the client has gone; polled, also while tokens flow.

        Nobody awaits this task, so it must not fail silently: an error while polling counts as the
        client being gone (the request is aborted and logged, never left running unwatched).
        """
        try:
            while not stream.finished:
                await asyncio.sleep(DISCONNECT_POLL_S)
                if await raw.is_disconnected():
                    break
            else:
                return
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("checking whether the client of %s is still there failed; aborting it", stream.request_id)
        gone.set()
        stream.abort()

    async def final_output(self, stream: RequestStream, raw: Request) -> RequestOutput:
        final = None
        async for out in self.outputs(stream, raw):
            final = out
        if final is None or not final.finished:
            raise ClientDisconnected()
        return final

    def prompt_logprobs(self, out: RequestOutput) -> p.PromptLogprobs | None:
        if out.prompt_logprobs is None:
            return None
        return prompt_logprobs(out.prompt_logprobs, self.decode_token)

    def echo_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else "".join(self.decode_token(t) for t in ids)

    # ---- /v1/completions ------------------------------------------------------------------------
    async def completion(self, body: p.CompletionRequest, raw: Request) -> Response:
        """One engine request per prompt (a list of prompts is a batch), n samples each (choices.py)."""
        lora, model = self.check_model(body.model), self.models.response_name(body.model)
        if body.use_beam_search:
            return await beam_search.completion(self, body, raw, lora, model)
        prompts = await asyncio.to_thread(lambda: [self.tokenize_prompt(prompt, body.truncate_prompt_tokens)
                                                   for prompt in c.prompt_list(body.prompt)])
        params = [self.sampling_params(body, len(ids)) for _, ids in prompts]
        c.check_best_of(body.best_of, params[0].n)
        if body.echo and body.logprobs is not None:  # the echoed prompt's logprobs: the engine scores it
            params = [c.with_prompt_logprobs(sp, body.logprobs) for sp in params]
        with structured_output_errors(body.structured_output_field):
            request_id, streams = await c.submit_all(self.engine, "cmpl", prompts, params, body, lora)
        echoes = [self.echo_text(text, ids) if body.echo else "" for text, ids in prompts]
        if body.stream:
            return sse_response(self._completion_events(request_id, streams, raw, body, params[0], prompts, echoes))
        outs = await c.gather_all([self.final_output(stream, raw) for stream in streams], streams)
        n, k = params[0].n, params[0].logprobs
        choices = []
        for i, out in enumerate(outs):
            for comp in out.outputs:
                logprobs = None
                if k is not None:
                    logprobs = completion_logprobs(comp.token_ids, comp.logprobs or [], k, self.decode_token,
                                                     len(echoes[i]))
                    if body.echo:
                        logprobs = joined(echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, k,
                                                            self.decode_token), logprobs)
                choices.append(p.CompletionResponseChoice(
                    index=i * n + comp.index, text=echoes[i] + comp.text, logprobs=logprobs,
                    finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                    prompt_logprobs=self.prompt_logprobs(out) if body.prompt_logprobs is not None else None))
        resp = p.CompletionResponse(id=request_id, model=model, choices=choices,
                                    usage=c.usage([len(ids) for _, ids in prompts], outs))
        return _json(resp)

    async def _completion_events(self, request_id: str, streams: list[RequestStream], raw: Request,
                                 body: p.CompletionRequest, params: SamplingParams,
                                 prompts: list[tuple[str | None, list[int]]], echoes: list[str]) -> AsyncIterator[str]:
        created, k, model = int(time.time()), params.logprobs, self.models.response_name(body.model)
        states = c.ChoiceStates(params.n, lambda: TextStreamer(params.stop))

        prompt_tokens, cached = sum(len(ids) for _, ids in prompts), [0] * len(prompts)  # cached: per prompt

        def chunk(index: int, text: str, **kw: Any) -> str:
            choice = p.CompletionChoice(index=index, text=text, **kw)
            usage = p.UsageInfo.of(prompt_tokens, states.completion_tokens()) if body.continuous_usage else None
            return sse(p.CompletionStreamResponse(id=request_id, created=created, model=model,
                                                   choices=[choice], usage=usage))

        try:
            if body.echo and k is None:
                for i, j in itertools.product(range(len(prompts)), range(params.n)):
                    yield chunk(states.index(i, j), echoes[i])
            async with c.merging([self.outputs(stream, raw) for stream in streams]) as items:
                async for i, out in items:
                    cached[i] = out.num_cached_tokens
                    for comp in out.outputs:
                        state, index = states.get(i, comp.index), states.index(i, comp.index)
                        if body.echo and k is not None and not state.echoed:  # prompt logprobs came with this output
                            state.echoed, state.text_offset = True, len(echoes[i])
                            yield chunk(index, echoes[i], logprobs=echo_logprobs(
                                out.prompt_token_ids, out.prompt_logprobs, k, self.decode_token))
                        was_done = state.done
                        delta, ids, lps = state.advance(comp)
                        finished = state.done and not was_done
                        logprobs = None
                        if k is not None and ids:
                            logprobs = completion_logprobs(ids, lps, k, self.decode_token, state.text_offset)
                            state.text_offset += sum(len(t) for t in logprobs.tokens)
                        if delta or logprobs is not None or finished:
                            yield chunk(index, delta, logprobs=logprobs,
                                        finish_reason=comp.finish_reason if finished else None,
                                        stop_reason=comp.stop_reason if finished else None)
            if body.include_usage:
                usage = p.UsageInfo.of(prompt_tokens, states.completion_tokens(), sum(cached))
                yield sse(p.CompletionStreamResponse(id=request_id, created=created, model=model,
                                                      choices=[], usage=usage))
        except ClientDisconnected:
            return
        except (EngineStepError, EngineDeadError) as exc:
            yield sse(stream_error_event(exc))
        yield "data: [DONE]\n\n"

    # ---- /v1/chat/completions -------------------------------------------------------------------
    async def chat(self, body: p.ChatCompletionRequest, raw: Request) -> Response:
        lora, model = self.check_model(body.model), self.models.response_name(body.model)
        if body.use_beam_search:
            return await beam_search.chat(self, body, raw, lora, model)
        body.use_tool_parser(self.tool_parser)
        text, ids = await asyncio.to_thread(self.chat_prompt, body)
        params = self.sampling_params(body, len(ids))
        with structured_output_errors(body.structured_output_field):  # a constraint that does not compile: 400
            _, (stream,) = await c.submit_all(self.engine, "chatcmpl", [(text, ids)], [params], body, lora)
        if body.stream:
            return sse_response(self._chat_events(stream, raw, body, params, len(ids)))
        out = await self.final_output(stream, raw)
        choices, shape = [], body.output_shape()  # plain text, or tool calls (tool_calls.py)
        for comp in out.outputs:  # n samples, in index order
            logprobs = None
            if params.logprobs is not None:
                logprobs = chat_logprobs(comp.token_ids, comp.logprobs or [], params.logprobs, self.decode_token,
                                          self.token_bytes)
            content, calls, reason = shape.message(comp.text, comp.finish_reason)
            choices.append(p.ChatChoice(index=comp.index, message=p.ChatResponseMessage(content=content, tool_calls=calls),
                                        logprobs=logprobs, finish_reason=reason, stop_reason=comp.stop_reason))
        resp = p.ChatCompletionResponse(id=stream.request_id, model=model, choices=choices,
                                        usage=c.usage([len(ids)], [out]), prompt_logprobs=self.prompt_logprobs(out))
        return _json(resp)

    async def _chat_events(self, stream: RequestStream, raw: Request, body: p.ChatCompletionRequest,
                           params: SamplingParams, prompt_len: int) -> AsyncIterator[str]:
        created, k, shape = int(time.time()), params.logprobs, body.output_shape()
        model = self.models.response_name(body.model)
        states = c.ChoiceStates(params.n, lambda: TextStreamer(params.stop))
        shaped = {j: shape.stream() for j in range(params.n)}  # text, or tool calls (tool_calls.py)
        cached = 0  # prompt tokens the prefix cache served, for the final usage

        def chunk(choices: list[p.ChatStreamChoice], usage: p.UsageInfo | None = None) -> str:
            if usage is None and body.continuous_usage:
                usage = p.UsageInfo.of(prompt_len, states.completion_tokens())
            return sse(p.ChatCompletionChunk(id=stream.request_id, created=created, model=model, choices=choices,
                                              usage=usage))

        try:
            for j in range(params.n):
                yield chunk([p.ChatStreamChoice(index=j, delta=p.DeltaMessage(role="assistant", content=""))])
            async for out in self.outputs(stream, raw):
                cached = out.num_cached_tokens
                for comp in out.outputs:
                    state = states.get(0, comp.index)
                    was_done = state.done
                    delta, ids, lps = state.advance(comp)
                    logprobs = chat_logprobs(ids, lps, k, self.decode_token, self.token_bytes) if k is not None and ids else None
                    content, tool_calls = shaped[comp.index].delta(delta)
                    if content or tool_calls or logprobs is not None:
                        yield chunk([p.ChatStreamChoice(index=comp.index, logprobs=logprobs,
                                                        delta=p.DeltaMessage(content=content, tool_calls=tool_calls))])
                    if state.done and not was_done:
                        content, tool_calls, reason = shaped[comp.index].finish(comp.finish_reason)
                        if content or tool_calls:
                            yield chunk([p.ChatStreamChoice(index=comp.index, delta=p.DeltaMessage(
                                content=content, tool_calls=tool_calls))])
                        yield chunk([p.ChatStreamChoice(index=comp.index, delta=p.DeltaMessage(),
                                                        finish_reason=reason)])
            if body.include_usage:
                yield chunk([], usage=p.UsageInfo.of(prompt_len, states.completion_tokens(), cached))
        except ClientDisconnected:
            return
        except (EngineStepError, EngineDeadError) as exc:
            yield sse(stream_error_event(exc))
        yield "data: [DONE]\n\n"


def _json(model: p.OpenAIModel) -> Response:
    """Pydantic's JSON (a non-finite logprob becomes null) rather than json.dumps, which rejects it."""
    return Response(model.model_dump_json(), media_type="application/json")


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              metrics: ServerMetrics | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              tool_call_parser: str | None = None, lora_modules: list[str] | None = None,
              allow_runtime_lora_updating: bool = False) -> FastAPI:
    """An app serving `engine` as model `served_model_name`; /v1 routes need `api_key` if given;
    `tool_call_parser` (a name in tool_parsers.PARSERS) serves tool_choice "auto"; `lora_modules`
    ("name=path") serve LoRA adapters under their own names (adapters.py)."""
    from kvflow import __version__

    metrics = metrics or ServerMetrics(served_model_name)
    models = ServedModels.from_specs(served_model_name, lora_modules)
    server = OpenAIServer(engine, models, metrics, tool_parser=make_tool_parser(tool_call_parser))
    app = FastAPI(title="kvflow", version=__version__)
    app.state.kvflow = server
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    app.state.drain = DrainState()  # outermost: a draining server refuses before anything else runs
    app.add_middleware(DrainMiddleware, state=app.state.drain)
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        return error_response(503, "the engine is not running (shut down or crashed)", "server_error",
                              code="engine_dead")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(engine.get_stats()), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> p.ModelCard:
        defaults = engine.sampling_defaults
        return p.ModelCard(id=served_model_name, root=getattr(engine, "model_path", None),
                           max_model_len=engine.max_model_len, sampling_defaults=dict(defaults.values),
                           sampling_defaults_source=defaults.source)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return p.ModelList(data=models.cards(model_card())).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        server.check_model(model_id)
        return next(card for card in models.cards(model_card()) if card.id == model_id).model_dump()

    if runtime_updating_allowed(allow_runtime_lora_updating):
        register_adapter_routes(app, models, engine)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, raw: Request) -> Response:
        return await server.completion(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, raw: Request) -> Response:
        return await server.chat(body, raw)

    @app.get("/kv_transfer")  # the KV connector's role, address and counters (kvflow router --prefill reads it)
    async def kv_transfer() -> Response:
        from kvflow.distributed.kv_transfer.zmq_connector import kv_transfer_info

        info = engine.kv_transfer_info() if hasattr(engine, "kv_transfer_info") else kv_transfer_info(engine)
        return Response(json.dumps(info), media_type="application/json") if info else error_response(
            404, "this instance has no --kv-transfer-config", code="kv_transfer_disabled")

    register_tokenization(app, server)
    register_embeddings(app, server)
    register_dashboard(app, engine, metrics, served_model_name, api_key)
    return app
