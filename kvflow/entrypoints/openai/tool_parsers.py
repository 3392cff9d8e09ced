"""Tool calls the model chose to make (`tool_choice` "auto"), read from its own output format.

Which format a model writes is a property of its chat template, so the server is told with
`kvflow serve --enable-auto-tool-choice --tool-call-parser NAME` (vLLM's flags):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, one per call,
  after any text. Qwen2.5 and Qwen3 templates (architectures kvflow runs) ask for this format.

A parser gives the message (text before the first call, and the calls). The streaming side sends
text as it comes until a call may be starting (a tail that could begin `<tool_call>` is held
back), then holds everything and reads the calls once the output ends, so the streamed content is
exactly the non-streamed one. Output that does not parse as calls is returned as text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kvflow.entrypoints.openai.tool_calls import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall


class HermesToolParser:
    """`<tool_call>` blocks of JSON objects with a name and arguments."""

    start, end = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text before the calls, or None; the calls). No calls: (text, [])."""
        first = text.find(self.start)
        if first < 0:
            return text, []
        calls = []
        for block in self._block.findall(text[first:]):
            try:
                value = json.loads(block)
            except ValueError:
                return text, []
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                return text, []
            arguments = value.get("arguments", value.get("parameters", {}))
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            calls.append(ToolCall(function=FunctionCall(name=value["name"], arguments=arguments)))
        return text[:first].rstrip() or None, calls

    def message(self, text: str, reason: str | None) -> tuple[str | None, list[ToolCall] | None, str | None]:
        content, calls = self.parse(text)
        return (content, calls, "tool_calls") if calls else (text, None, reason)

    def stream(self) -> "AutoToolStream":
        return AutoToolStream(self)

    def content_end(self, text: str) -> int:
        """How much of a growing output is surely text: up to a call's start (or a tail that may
        become one), without the whitespace before it, which a call would drop."""
        i = text.find(self.start)
        if i < 0:
            i = len(text) - _prefix_overlap(text, self.start)
        return len(text[:i].rstrip())


def _prefix_overlap(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


PARSERS = {"hermes": HermesToolParser}


def make_tool_parser(name: str | None) -> HermesToolParser | None:
    """The parser called `name` (None: no parser, tool_choice "auto" is refused)."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; supported: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


@dataclass
class AutoToolStream:
    """One choice's stream under tool_choice "auto": text until a call may start, calls at the end."""

    parser: HermesToolParser
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
