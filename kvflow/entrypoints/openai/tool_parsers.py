"""Tool calls the model chose to make (`tool_choice` "auto"), read from its own output format.

Which format a model writes is a property of its chat template, so the server is told with
`kvflow serve --enable-auto-tool-choice --tool-call-parser NAME` (vLLM's flags and names):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, one per call,
  after any text. Qwen2.5 and Qwen3 templates ask for this format.
- `llama3_json`: the whole output is the calls, JSON objects `{"name": ..., "parameters": {...}}`
  separated by `;`, maybe after `<|python_tag|>`. Llama 3.1-3.3 templates ask for this format
  when tools are given; a call is recognised only at the start of the output, as vLLM does.
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects (Mistral's v3
  tokenizer), or `name[ARGS]{...}` per call (v11 and later), after any text. `[TOOL_CALLS]` is a
  special token, so a request read by this parser keeps special tokens in its text (as vLLM does).

A parser gives the message (text before the first call, and the calls). The streaming side sends
text as it comes until a call may be starting (a tail that could begin one is held back), then
holds everything and reads the calls once the output ends, so the streamed content is exactly the
non-streamed one. Output that does not parse as calls is returned as text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvflow.entrypoints.openai.tool_calls import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall


class ToolParser:
    """One tool-call format: where the calls start in an output, and how they read."""

    needs_special_tokens = False  # True: the format's marker is a special token the text must keep

    def call_start(self, text: str) -> int:
        """Where the calls begin in `text`, or -1."""
        raise NotImplementedError

    def held_tail(self, text: str) -> int:
        """How many of `text`'s last characters may still grow into the start of a call."""
        raise NotImplementedError

    def read_calls(self, calls_text: str) -> list[ToolCall] | None:
        """The calls written from `call_start` on; None when they do not parse (the output is text)."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text before the calls, or None; the calls). No calls: (text, [])."""
        first = self.call_start(text)
        calls = self.read_calls(text[first:]) if first >= 0 else None
        if not calls:
            return text, []
        return text[:first].rstrip() or None, calls

    def message(self, text: str, reason: str | None) -> tuple[str | None, list[ToolCall] | None, str | None]:
        content, calls = self.parse(text)
        return (content, calls, "tool_calls") if calls else (text, None, reason)

    def stream(self) -> "AutoToolStream":
        return AutoToolStream(self)

    def content_end(self, text: str) -> int:
        """How much of a growing output is surely text: up to a call's start (or a tail that may
        become one), without the whitespace before it, which a call would drop."""
        i = self.call_start(text)
        if i < 0:
            i = len(text) - self.held_tail(text)
        return len(text[:i].rstrip())


def _call(value: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A decoded JSON call object as a ToolCall, or None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[k] for k in arguments_keys if k in value), {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(function=FunctionCall(name=value["name"], arguments=arguments))


class HermesToolParser(ToolParser):
    """`<tool_call>` blocks of JSON objects with a name and arguments."""

    start = "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def call_start(self, text: str) -> int:
        return text.find(self.start)

    def held_tail(self, text: str) -> int:
        return _prefix_overlap(text, self.start)

    def read_calls(self, calls_text: str) -> list[ToolCall] | None:
        calls = []
        for block in self._block.findall(calls_text):
            try:
                call = _call(json.loads(block))
            except ValueError:
                return None
            if call is None:
                return None
            calls.append(call)
        return calls


class Llama3JsonToolParser(ToolParser):
    """The output as `;`-separated JSON call objects, maybe after `<|python_tag|>`."""

    tag = "<|python_tag|>"

    def call_start(self, text: str) -> int:
        body = text.lstrip()
        return len(text) - len(body) if body.startswith(("{", self.tag)) else -1

    def held_tail(self, text: str) -> int:
        body = text.lstrip()
        return len(text) if self.tag.startswith(body) else 0  # nothing yet, or a tag's beginning

    def read_calls(self, calls_text: str) -> list[ToolCall] | None:
        rest, calls, decoder = calls_text.strip().removeprefix(self.tag), [], json.JSONDecoder()
        while rest.strip():
            try:
                value, end = decoder.raw_decode(rest.strip())
            except ValueError:
                return None
            call = _call(value, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            rest = rest.strip()[end:].lstrip()
            if rest and not rest.startswith(";"):
                return None
            rest = rest.removeprefix(";")
        return calls


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS]` then a JSON list (or object) of calls, or `name[ARGS]{...}` per call."""

    start, args = "[TOOL_CALLS]", "[ARGS]"
    needs_special_tokens = True

    def call_start(self, text: str) -> int:
        return text.find(self.start)

    def held_tail(self, text: str) -> int:
        return _prefix_overlap(text, self.start)

    def read_calls(self, calls_text: str) -> list[ToolCall] | None:
        parts = [p.strip() for p in calls_text.split(self.start) if p.strip()]
        if not parts:
            return None
        calls: list[ToolCall | None] = []
        for part in parts:
            if self.args in part:  # v11: name[ARGS]{...}
                name, _, arguments = part.partition(self.args)
                try:
                    json.loads(arguments)
                except ValueError:
                    return None
                calls.append(ToolCall(function=FunctionCall(name=name.strip(), arguments=arguments.strip()))
                             if name.strip() else None)
                continue
            try:  # v3: a JSON list of calls, or one call
                value, end = json.JSONDecoder().raw_decode(part)
            except ValueError:
                return None
            if part[end:].strip():
                return None
            calls += [_call(v) for v in (value if isinstance(value, list) else [value])]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def _prefix_overlap(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser}


def make_tool_parser(name: str | None) -> ToolParser | None:
    """The parser called `name` (None: no parser, tool_choice "auto" is refused)."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; supported: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


@dataclass
class AutoToolStream:
    """One choice's stream under tool_choice "auto": text until a call may start, calls at the end."""

    parser: ToolParser
    text: str = ""
    sent: int = 0

    def delta(self, piece: str) -> tuple[str | None, list[DeltaToolCall] | None]:
        self.text += piece
        end = max(self.parser.content_end(self.text), self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out or None, None

    def finish(self, reason: str | None) -> tuple[str | None, list[DeltaToolCall] | None, str | None]:
        content, calls = self.parser.parse(self.text)
        if not calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest or None, None, reason
        rest = (content or "")[self.sent:]
        return rest or None, [DeltaToolCall(index=i, id=c.id, type="function", function=DeltaFunctionCall(
            name=c.function.name, arguments=c.function.arguments)) for i, c in enumerate(calls)], "tool_calls"
