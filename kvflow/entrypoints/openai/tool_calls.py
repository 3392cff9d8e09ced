"""OpenAI's function calling: how a chat choice's output becomes its message.

Every chat choice has an output shape (`ToolFields.output_shape`): plain text; a call forced by
`tool_choice` (below); or, with `tool_choice` "auto" on a server started with a tool-call parser,
calls the model chose to write in its own format (tool_parsers.py). A shape turns a finished
output into (content, tool_calls, finish_reason), and makes a per-choice stream for SSE.

A forced call needs no parser for the model's own tool-call format: the output is constrained
by the grammar engine (structured output) to the JSON the call must be, and read back from it.
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is that
  function's arguments, an object following its `parameters` schema;
- "required": the output is a JSON array of one or more `{"name", "parameters"}` objects, each
  naming one of `tools` with arguments that follow its schema (exactly one when
  `parallel_tool_calls` is false).
The answer carries `message.tool_calls` (content null), with OpenAI's finish_reason: "tool_calls"
for "required", the output's own ("stop", or "length" when max_tokens cut the arguments short)
for a named function. "required" calls cut short cannot be read back: they come as the text they
got to, with finish_reason "length". "auto" (the model decides whether to call) needs the parser of
the model's own format; without one (`kvflow serve --tool-call-parser`) it is refused with the
values that work, not ignored. `tools` also reach the chat template (`tools=`), for templates
that describe them to the model.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_serializer

from kvflow.structured_output.params import StructuredOutputsParams


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(_Wire):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: the function takes no arguments
    strict: bool | None = None  # always honoured: the grammar enforces the schema


class ChatTool(_Wire):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Wire):
    name: str


class NamedToolChoice(_Wire):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Wire):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Wire):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class _Sparse(_Wire):
    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """A streamed delta carries only what changed."""
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Sparse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Sparse):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


@dataclass
class ForcedCall:
    """What a request's tool_choice forces: `function` named, or (None) "required" over `tools`."""

    function: str | None
    tools: dict[str, dict[str, Any]]  # name -> parameters schema
    single: bool = False  # "required" with parallel_tool_calls=false

    def constraint(self) -> StructuredOutputsParams:
        if self.function is not None:
            return StructuredOutputsParams(json=self.tools[self.function])
        one_of = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                   "required": ["name", "parameters"], "additionalProperties": False}
                  for name, schema in self.tools.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if self.single:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    def read(self, text: str) -> list[ToolCall] | None:
        """The calls in an output. A named function's arguments are the text, complete or not (as
        they were streamed); "required" calls need the whole array, else None (cut by max_tokens)."""
        if self.function is not None:
            return [ToolCall(function=FunctionCall(name=self.function, arguments=text))]
        try:
            value = json.loads(text)
        except ValueError:
            return None
        return [ToolCall(function=FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"], ensure_ascii=False)))
                for c in value]

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (here: "required"); a forced named
        function ends as its output did ("stop", or "length" when cut short)."""
        return "tool_calls" if called and self.function is None else reason

    def message(self, text: str, reason: str | None) -> tuple[str | None, list[ToolCall] | None, str | None]:
        calls = self.read(text)
        return (None if calls else text), calls, self.finish_reason(bool(calls), reason)

    def stream(self) -> "ForcedCallStream":
        return ForcedCallStream(self)


class PlainText:
    """No tools in play: the output is the message's content."""

    def message(self, text: str, reason: str | None) -> tuple[str | None, list[ToolCall] | None, str | None]:
        return text, None, reason

    def stream(self) -> "PlainText":
        return self

    def delta(self, piece: str) -> tuple[str | None, list[DeltaToolCall] | None]:
        return piece or None, None

    def finish(self, reason: str | None) -> tuple[str | None, list[DeltaToolCall] | None, str | None]:
        return None, None, reason


PLAIN = PlainText()


class ToolFields(_Wire):
    """The chat request's function-calling fields."""

    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    _tool_parser: Any = PrivateAttr(default=None)  # the server's, for "auto" (tool_parsers.py)

    def use_tool_parser(self, parser: Any) -> None:
        """Let "auto" read calls with `parser` (the server's --tool-call-parser; None: refuse "auto").
        A format whose call marker is a special token keeps special tokens in the text, or the
        parser would never see the marker (vLLM does the same)."""
        self._tool_parser = parser
        if parser is not None and parser.needs_special_tokens and self.output_shape() is parser:
            self.skip_special_tokens = False

    def output_shape(self) -> Any:
        """How this request's output becomes a message: a forced call, the parser, or plain text."""
        forced = self.forced_call()
        if forced is not None:
            return forced
        if self.tools and self.tool_choice in (None, "auto"):
            return self._tool_parser
        return PLAIN

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def forced_call(self) -> ForcedCall | None:
        """The call tool_choice forces, None for "none" (or no tools); ValueError naming the field otherwise."""
        choice = self.tool_choice
        if choice is None:
            choice = "auto" if self.tools else "none"
        if choice == "none":
            return None
        if not self.tools:
            raise ValueError(f"tool_choice {_show(choice)} needs `tools` to choose from")
        tools = {t.function.name: t.function.parameters or {"type": "object", "properties": {}} for t in self.tools}
        if len(tools) < len(self.tools):
            raise ValueError("tools: two functions have the same name")
        if choice == "auto":
            if self._tool_parser is not None:
                return None  # the model decides; the parser reads what it wrote
            raise ValueError(
                "tool_choice 'auto' (the default when `tools` are given) lets the model decide whether to call a "
                "tool, which needs a parser for this model's tool-call format: start the server with "
                "--enable-auto-tool-choice --tool-call-parser NAME. Or use tool_choice 'required', a named "
                "function ({\"type\": \"function\", \"function\": {\"name\": ...}}) or 'none'")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in tools:
                raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in `tools` "
                                 f"({', '.join(tools)})")
            return ForcedCall(choice.function.name, tools)
        return ForcedCall(None, tools, single=self.parallel_tool_calls is False)


def _show(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def template_message_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """An assistant message's earlier calls as chat templates read them: arguments as an object
    where they are JSON (Hugging Face's convention), else the text."""
    out = []
    for call in calls:
        try:
            arguments: Any = json.loads(call.function.arguments)
        except ValueError:
            arguments = call.function.arguments
        out.append({"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments}})
    return out


@dataclass
class ForcedCallStream:
    """One choice's stream under a forced call: a named function's arguments stream as they come;
    "required" calls are read whole at the end (their JSON array has to be complete first)."""

    forced: ForcedCall
    text: list[str] = field(default_factory=list)
    started: bool = False

    def delta(self, piece: str) -> tuple[str | None, list[DeltaToolCall] | None]:
        self.text.append(piece)
        if self.forced.function is None or not piece:
            return None, None
        head = {} if self.started else {"id": ToolCall(function=FunctionCall(name="", arguments="")).id,
                                        "type": "function"}
        name = None if self.started else self.forced.function
        self.started = True
        return None, [DeltaToolCall(index=0, **head, function=DeltaFunctionCall(name=name, arguments=piece))]

    def finish(self, reason: str | None) -> tuple[str | None, list[DeltaToolCall] | None, str | None]:
        """At the end: (the text of a "required" output that is not a complete list, the "required"
        calls as one delta, the finish reason). A named function's arguments are all out already."""
        if self.forced.function is not None:
            return None, None, reason
        text = "".join(self.text)
        calls = self.forced.read(text)
        if calls is None:
            return text or None, None, reason
        return None, [DeltaToolCall(index=i, id=c.id, type="function",
                                    function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
                      for i, c in enumerate(calls)], self.forced.finish_reason(True, reason)
