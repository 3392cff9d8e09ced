"""The models a server answers to: its base model and the LoRA adapters served over it.

`kvflow serve --enable-lora --lora-modules name=path ...` (vLLM's flags) serves each adapter
under its own model name: a request's `model` picks it, /v1/models lists it with the base
model as its `parent`, and responses carry the name asked for. An unknown name is a 404, as
OpenAI's API answers. With `--allow-runtime-lora-updating` (or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), POST /v1/load_lora_adapter and
/v1/unload_lora_adapter add and drop adapters while the server runs.

The engine loads an adapter's weights the first time a request names it, and keeps the ones
in use; the folder itself is checked when the name is registered, so a typo in a path stops
`kvflow serve` before the weights load.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from kvflow.entrypoints.openai import protocol as p
from kvflow.lora.adapter import read_adapter_config
from kvflow.lora.request import LoRARequest

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def parse_lora_module(spec: str) -> tuple[str, str]:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON form {"name": ..., "path": ...}."""
    if spec.lstrip().startswith("{"):
        try:
            entry = json.loads(spec)
            return str(entry["name"]), str(entry["path"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"--lora-modules: {spec!r} is not name=path nor JSON with name and path ({exc})") from None
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {spec!r} is not name=path")
    return name, path


@dataclass
class ServedModels:
    base_name: str
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    _next_id: int = 1

    @classmethod
    def from_specs(cls, base_name: str, specs: list[str] | None) -> ServedModels:
        models = cls(base_name)
        for spec in specs or []:
            models.register(*parse_lora_module(spec))
        return models

    def register(self, name: str, path: str) -> LoRARequest:
        """A new adapter name; ValueError when the name is taken or the folder is not a LoRA adapter
        kvflow can serve (its weights are checked against the model when first used)."""
        if name == self.base_name or name in self.adapters:
            raise ValueError(f"lora_name: the model name {name!r} is already served")
        read_adapter_config(os.path.abspath(path))
        request = self.adapters[name] = LoRARequest(name, self._next_id, os.path.abspath(path))
        self._next_id += 1
        return request

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for a name not served."""
        if model is None or model == self.base_name:
            return None
        if model in self.adapters:
            return self.adapters[model]
        raise p.InvalidRequestError(f"The model `{model}` does not exist.", param="model", status=404,
                                    code="model_not_found")

    def response_name(self, model: str | None) -> str:
        """The model name a response carries: the adapter's when the request named one."""
        return model if model in self.adapters else self.base_name

    def cards(self, base: p.ModelCard) -> list[p.ModelCard]:
        return [base, *(p.ModelCard(id=name, root=r.lora_path, parent=self.base_name, max_model_len=base.max_model_len)
                        for name, r in self.adapters.items())]


class LoadLoRAAdapterRequest(p.OpenAIModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(p.OpenAIModel):
    lora_name: str
    lora_int_id: int | None = None


def _load_in_engine(engine: Any, request: LoRARequest) -> None:
    engine.add_lora(request)


def _remove_in_engine(engine: Any, lora_int_id: int) -> bool:
    return engine.remove_lora(lora_int_id)


def runtime_updating_allowed(flag: bool) -> bool:
    return flag or os.environ.get(RUNTIME_UPDATING_ENV, "").lower() in ("1", "true")


def register_adapter_routes(app: FastAPI, models: ServedModels, engine: Any) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes and answers)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        if body.lora_name in models.adapters or body.lora_name == models.base_name:
            raise p.InvalidRequestError(f"The lora adapter '{body.lora_name}' has already been loaded.",
                                        param="lora_name")
        try:
            request = models.register(body.lora_name, body.lora_path)
        except ValueError as exc:
            raise p.InvalidRequestError(str(exc), param="lora_path") from None
        try:  # the weights, checked against the model now rather than at the first request
            await engine.call(functools.partial(_load_in_engine, request=request))
        except BaseException as exc:
            del models.adapters[body.lora_name]
            if isinstance(exc, ValueError):
                raise p.InvalidRequestError(str(exc), param="lora_path") from None
            raise
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        request = models.adapters.pop(body.lora_name, None)
        if request is None:
            raise p.InvalidRequestError(f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                                        status=404, code="model_not_found")
        # Requests already running keep it until they finish; after that the engine's cache evicts it.
        await engine.call(functools.partial(_remove_in_engine, lora_int_id=request.lora_int_id))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
