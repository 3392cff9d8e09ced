"""Property-based fuzzing of every endpoint in the server's own OpenAPI schema (schemathesis).

Schemathesis reads `app.openapi()` and generates requests for each operation, both ones the
schema allows (positive) and ones it forbids (negative: wrong types, missing fields, values
out of range). Each case is sent to the app, served in this process on a loopback port,
and must get:

- no 5xx, and no error event inside a 200 stream;
- an answer within CASE_DEADLINE_S (a stream read to its end; a GET stream, a live feed by
  design, only to its first bytes);
- for every refusal, OpenAI's error shape {"error": {"message", "type", "param", "code"}}.

Afterwards no engine step has failed and every KV block is back in the pool. The model is a
tiny random Llama with SmolLM2's tokenizer and chat template (so text, templates and token ids
all go through the real paths) and a 96-token context, so that no generated case can run
long; the number of examples is fixed and the generation derandomized, so the test is repeatable.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from kvflow.config import EngineConfig
from kvflow.entrypoints.async_engine import AsyncEngine
from kvflow.entrypoints.openai.server import build_app

from tests.conftest import save_tiny_llama
from .conftest import MODEL_NAME, httpx, serving, wait_engine_idle

CASE_DEADLINE_S = 30.0
EXAMPLES = 30  # per operation and generation mode
MAX_MODEL_LEN = 96
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, smollm2_gguf):
    path, _ = save_tiny_llama(tmp_path_factory.mktemp("fuzz-llama"), vocab_size=49152)
    config = EngineConfig(model=path, tokenizer=smollm2_gguf, dtype="float32", max_model_len=MAX_MODEL_LEN,
                          kv_cache_memory=16 << 20, seed=0)
    engine = AsyncEngine.from_config(config, max_waiting=256)
    app = build_app(engine, MODEL_NAME)
    try:
        with serving(app) as port:
            yield app, f"http://127.0.0.1:{port}", engine
    finally:
        engine.shutdown()


@dataclass
class Findings:
    """Failures by operation, each with the request that caused it (the first few kept)."""

    by_operation: dict[str, list[str]] = field(default_factory=dict)
    statuses: Counter = field(default_factory=Counter)  # (operation, status) -> cases

    def add(self, operation: str, problem: str, kwargs: dict) -> None:
        found = self.by_operation.setdefault(operation, [])
        if len(found) < 5:
            found.append(f"{problem}\n    request: {json.dumps(kwargs, default=repr)[:600]}")


def check_error_shape(payload: object) -> str | None:
    """None if `payload` is {"error": {message, type, param, code}} with a message; else what is wrong."""
    if not isinstance(payload, dict) or set(payload) != {"error"} or not isinstance(payload["error"], dict):
        return f"not an OpenAI error: {str(payload)[:300]}"
    err = payload["error"]
    if set(err) != ERROR_KEYS:
        return f"error keys {sorted(err)} != {sorted(ERROR_KEYS)}"
    if not isinstance(err["message"], str) or not err["message"] or not isinstance(err["type"], str):
        return f"error without a message or type: {err}"
    if err["param"] is not None and not isinstance(err["param"], str):
        return f"error param is not a string: {err}"
    return None


def send_and_check(client: httpx.Client, kwargs: dict) -> tuple[int | None, str | None]:
    """Send one generated request: its status, and None if the answer is acceptable, else what is wrong."""
    kwargs = dict(kwargs)
    kwargs.pop("cookies", None)
    if isinstance(kwargs.get("data"), (bytes, str)):
        kwargs["content"] = kwargs.pop("data")
    started = time.monotonic()
    try:
        with client.stream(**kwargs) as r:
            events = r.headers.get("content-type", "").startswith("text/event-stream")
            if events and kwargs["method"].upper() == "GET":
                next(r.iter_bytes(), b"")  # a live feed: its first bytes are the answer
                body = b""
            else:
                chunks = []
                for chunk in r.iter_bytes():
                    chunks.append(chunk)
                    if time.monotonic() - started > CASE_DEADLINE_S:
                        return r.status_code, f"no end after {CASE_DEADLINE_S} s"
                body = b"".join(chunks)
    except (httpx.LocalProtocolError, httpx.InvalidURL, httpx.UnsupportedProtocol):
        return None, None  # httpx itself will not send it (an invalid header, say): nothing reached the server
    except httpx.TimeoutException:
        return None, f"no answer within {CASE_DEADLINE_S} s"
    status = r.status_code
    if status >= 500:
        return status, f"status {status}: {body[:300]!r}"
    if status >= 400:
        try:
            return status, check_error_shape(json.loads(body))
        except ValueError:
            return status, f"status {status} with a body that is not JSON: {body[:300]!r}"
    if events and body:
        lines = [line for line in body.decode().split("\n") if line]
        if not lines or lines[-1] != "data: [DONE]":
            return status, f"stream does not end with [DONE]: {lines[-2:]}"
        for line in lines[:-1]:
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                return status, f"error inside a 200 stream: {event}"
    return status, None


def with_served_model(case: schemathesis.Case) -> schemathesis.Case:
    """Positive bodies name our model, so that generation itself is exercised, not only the 404."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL_NAME
    return case


def test_fuzz_every_endpoint_from_the_openapi_schema(fuzz_server):
    app, base_url, engine = fuzz_server
    schema = schemathesis.openapi.from_dict(app.openapi())
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = sorted(op.label for op in operations)
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health"} <= set(labels)
    findings = Findings()
    with httpx.Client(base_url=base_url, timeout=CASE_DEADLINE_S) as client:
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                strategy = operation.as_strategy(generation_mode=mode)
                if mode is GenerationMode.POSITIVE:
                    strategy = st.one_of(strategy, strategy.map(with_served_model))

                @given(case=strategy)
                @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
                def run(case: schemathesis.Case) -> None:
                    kwargs = case.as_transport_kwargs(base_url=base_url)
                    status, problem = send_and_check(client, kwargs)
                    findings.statuses[operation.label, status] += 1
                    if problem is not None:
                        findings.add(f"{operation.label} ({mode.value})", problem, kwargs)

                try:
                    run()
                except Unsatisfiable:  # nothing to get wrong: an operation without parameters or body
                    assert mode is GenerationMode.NEGATIVE, operation.label
    print(f"fuzzed {sum(findings.statuses.values())} requests: " +
          ", ".join(f"{op} {status}: {n}" for (op, status), n in sorted(findings.statuses.items(), key=str)))
    report = "\n".join(f"{op}:\n  " + "\n  ".join(problems) for op, problems in findings.by_operation.items())
    assert not findings.by_operation, report
    served = {op for (op, status), n in findings.statuses.items() if status == 200}
    # Generation itself was reached. Not necessarily on both routes: most generated completions
    # bodies are rightly refused (an empty prompt, token ids past the vocabulary, a prompt past the
    # 96-token context), and which ones hypothesis draws changes with every field the schema gains.
    assert served & {"POST /v1/completions", "POST /v1/chat/completions"}, findings.statuses
    assert engine.num_step_errors == 0
    assert wait_engine_idle(engine, 30), engine.get_stats()  # aborted streams too: every block is free
    engine.engine.check_integrity()
