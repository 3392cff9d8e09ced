"""Structured output on the wire: OpenAI's `response_format` and vLLM's `structured_outputs`.

Both request fields become one `StructuredOutputsParams` (kvflow/structured_output/params.py):
  {"type": "text"}                                     no constraint
  {"type": "json_object"}                              any JSON object
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
  "structured_outputs": {"json" | "regex" | "choice" | "grammar" | "json_object", ...}
So do vLLM's older top-level fields, which many clients still send (`extra_body=`):
  "guided_json" | "guided_regex" | "guided_choice" | "guided_grammar"
A request may use one of these ways, not two. Shape errors are 400s naming the field the
client sent (`response_format` or `structured_outputs`); so are schemas, regexes and grammars
the grammar engine cannot compile (the server maps `StructuredOutputError` the same way).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvflow.structured_output.params import StructuredOutputsParams


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`; `strict` is accepted and always honoured (the grammar enforces it)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` request field; unknown keys are refused, not silently unconstrained."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True  # kvflow's default: see StructuredOutputsParams


GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredOutputFields(BaseModel):
    """The request fields of a constraint, mixed into the completions and chat requests."""

    model_config = ConfigDict(extra="ignore")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _guided(self) -> list[str]:
        return [name for name in GUIDED_FIELDS if getattr(self, name) is not None]

    @property
    def structured_output_field(self) -> str | None:
        """The request field that carries the constraint, for error messages; None if unconstrained."""
        if self.structured_outputs is not None:
            return "structured_outputs"
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        guided = self._guided()
        return guided[0] if guided else None

    def structured_output_params(self) -> StructuredOutputsParams | None:
        """The constraint of this request, or None; InvalidRequestError (400) naming the field if malformed."""
        from kvflow.entrypoints.openai.protocol import InvalidRequestError  # protocol imports this module

        fmt, so = self.response_format, self.structured_outputs
        ways = ([] if so is None else ["structured_outputs"]) + (
            [] if fmt is None or fmt.type == "text" else ["response_format"]) + self._guided()
        if len(ways) > 1:
            both = f"either {ways[0]} or {ways[1]}, not both" if len(ways) == 2 else f"one of {', '.join(ways)}"
            raise InvalidRequestError(f"give {both}", param=ways[0])
        try:
            if ways and ways[0] in GUIDED_FIELDS:
                name = ways[0]
                return StructuredOutputsParams(**{GUIDED_FIELDS[name]: getattr(self, name)})
            if so is not None:
                return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                               json_object=so.json_object,
                                               disable_any_whitespace=so.disable_any_whitespace)
            if fmt is None or fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
        except ValueError as exc:
            field = ways[0] if ways else "structured_outputs"
            raise InvalidRequestError(name_field(str(exc), field), param=field) from None
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise InvalidRequestError("response_format: type json_schema needs json_schema.schema, the JSON schema "
                                      "the output must follow", param="response_format")
        return StructuredOutputsParams(json=fmt.json_schema.json_schema)


def name_field(message: str, field: str | None) -> str:
    """An engine message about `structured_outputs.<kind>` reworded for the field the client sent."""
    if field == "tool_choice" and message.startswith("structured_outputs.json"):
        return "tools: a function's parameters" + message[len("structured_outputs.json"):]
    if field in GUIDED_FIELDS:
        engine_name = "structured_outputs." + GUIDED_FIELDS[field]
        return field + message[len(engine_name):] if message.startswith(engine_name) else message
    if field != "response_format":
        return message
    for engine_name, wire_name in (("structured_outputs.json_object", "response_format"),
                                   ("structured_outputs.json", "response_format.json_schema.schema"),
                                   ("structured_outputs", "response_format")):
        if message.startswith(engine_name):
            return wire_name + message[len(engine_name):]
    return message
