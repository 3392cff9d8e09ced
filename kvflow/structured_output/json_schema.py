"""JSON-schema keywords the grammar engine would compile into nothing, found before compiling.

xgrammar turns a schema into a grammar, and a keyword it does not translate is dropped
silently: the output then breaks the schema while the request reports success (a
`uniqueItems` array came back as `[3, 3, 1]` with finish_reason "stop"). vLLM refuses such
schemas for its xgrammar backend; so does kvflow, naming the keyword and where it is, so the
client can drop it (and check that property itself) or rephrase it (an `enum`, a `pattern`).

The list was measured against xgrammar 0.2.9's own matcher: each keyword below let a
violating document through, or (`patternProperties`, `propertyNames`, `dependentSchemas`)
refused valid ones. `allOf`, `anyOf` and `oneOf` are enforced when they are the schema, beside
annotations only (pydantic's `{"anyOf": [...], "default": null}`, its `allOf` around a
`$ref`); beside a validating keyword (`"type": "integer", "anyOf": [...]`) the composition was
dropped, and of an `allOf` with several members only the first was kept.
"""

from __future__ import annotations

from typing import Any, Iterator

# keyword -> what it asks, for the message
UNENFORCED = {
    "uniqueItems": "distinct array items",
    "contains": "an array item matching a schema",
    "minContains": "a count of matching array items",
    "maxContains": "a count of matching array items",
    "not": "a negated schema",
    "if": "a conditional schema",
    "then": "a conditional schema",
    "else": "a conditional schema",
    "dependentRequired": "properties required by another's presence",
    "dependencies": "properties required by another's presence",  # draft 7's name
    "dependentSchemas": "schemas applied by another property's presence",
    "patternProperties": "properties named by a pattern",
    "propertyNames": "a schema for property names",
}

_COMPOSITIONS = ("allOf", "anyOf", "oneOf")
# Keywords that describe and validate nothing: a composition beside them is enforced.
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
                "$schema", "$id", "$defs", "definitions",
                "discriminator"}  # OpenAPI's, in pydantic's tagged unions: the oneOf is still enforced (measured)

# Where subschemas sit: keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedItems", "unevaluatedProperties",
        "not", "if", "then", "else", "contains", "propertyNames")
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def unenforced_keywords(schema: Any, path: str = "") -> Iterator[tuple[str, str, str]]:
    """(JSON pointer, keyword, what is lost) for every keyword of `schema` the grammar cannot enforce.

    Only schema positions are walked: a property named "not", or an `enum` value holding a dict,
    is data, not a keyword.
    """
    if not isinstance(schema, dict):
        return
    where = path or "/"
    for keyword, what in UNENFORCED.items():
        if keyword in schema and not (keyword == "uniqueItems" and schema[keyword] is False):
            yield where, keyword, what
    for keyword in _COMPOSITIONS:
        if keyword not in schema:
            continue
        beside = sorted(set(schema) - _ANNOTATIONS - {keyword})
        if beside:
            yield where, keyword, f"{keyword} beside {', '.join(beside)}"
        elif keyword == "allOf" and isinstance(schema[keyword], list) and len(schema[keyword]) > 1:
            yield where, keyword, "all of several schemas"
    for keyword in _ONE:
        if isinstance(schema.get(keyword), dict):
            yield from unenforced_keywords(schema[keyword], f"{path}/{keyword}")
    for keyword in _MANY:
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                yield from unenforced_keywords(sub, f"{path}/{keyword}/{i}")
    for keyword in _NAMED:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                yield from unenforced_keywords(sub, f"{path}/{keyword}/{_escape(name)}")


def describe_unenforced(schema: Any) -> str | None:
    """The refusal message for `schema`, or None when every keyword is enforced."""
    found = list(unenforced_keywords(schema))
    if not found:
        return None
    listed = "; ".join(f"{keyword!r} at {where} ({what})" for where, keyword, what in found[:5])
    more = f" and {len(found) - 5} more" if len(found) > 5 else ""
    return (f"the grammar engine (xgrammar) cannot enforce {listed}{more}, so the output could break the schema. "
            "Remove these keywords and check them on the output, or express them with enum, const, pattern "
            "or a plain anyOf")


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")  # RFC 6901
