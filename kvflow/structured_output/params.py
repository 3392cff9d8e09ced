"""What a request constrains its output to: vLLM's `StructuredOutputsParams`, checked at construction.

This module imports no grammar engine, so `SamplingParams` can carry the record and validate
its shape cheaply; compiling it into a grammar is `manager.py`'s job. Exactly one kind of
constraint per request (vLLM's rule): a JSON schema, any JSON object, a regular expression, a
closed list of choices, or an EBNF grammar (xgrammar's GBNF dialect).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One request's output constraint.

    `json` is a JSON schema, as a dict or a JSON string; `json_object=True` asks for any JSON
    object; `regex` must match the whole output; `choice` lists the exact strings allowed;
    `grammar` is EBNF with a `root` rule.

    `disable_any_whitespace` is vLLM's option, with the opposite default: JSON comes out on one
    line (`{"a": 1, "b": [2, 3]}`) unless it is set to False, which lets the model put any
    whitespace between tokens. Free whitespace lets a small model waste its budget: SmolLM2-135M
    at temperature 1.5 spent all of 96 tokens on newlines and spaces inside a 4-field object.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if not given:
            raise ValueError("structured_outputs: give exactly one of json, regex, choice, grammar or json_object; "
                             "got none")
        if len(given) > 1:
            raise ValueError(f"structured_outputs: give exactly one kind of constraint, got {', '.join(given)}")
        if self.json is not None:
            self._check_schema()
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            object.__setattr__(self, "choice", list(self.choice))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"structured_outputs.grammar must be a non-empty EBNF string, got {self.grammar!r}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be true or false, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be true or false, "
                             f"got {self.disable_any_whitespace!r}")

    def _check_schema(self) -> None:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError("structured_outputs.json must be a JSON schema object (a dict or a JSON string of "
                             f"one), got {type(schema).__name__}")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def schema(self) -> dict[str, Any]:
        """The JSON schema as a dict (parsed when it was given as text)."""
        return json.loads(self.json) if isinstance(self.json, str) else self.json

    def schema_text(self) -> str:
        """The JSON schema as compact text, keys in the caller's order (it is the order of the output's keys)."""
        return json.dumps(self.schema(), separators=(",", ":"))

    def cache_key(self) -> tuple:
        """Equal for constraints that compile to the same grammar: the compiled-grammar cache's key."""
        kind = self.kind
        if kind == "json":
            value: Any = self.schema_text()
        elif kind == "choice":
            value = tuple(self.choice or ())
        elif kind == "json_object":
            value = True
        else:
            value = getattr(self, kind)
        whitespace = self.disable_any_whitespace if kind in ("json", "json_object") else False
        return (kind, value, whitespace)

    def __hash__(self) -> int:
        return hash(self.cache_key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutputsParams) and self.cache_key() == other.cache_key()
