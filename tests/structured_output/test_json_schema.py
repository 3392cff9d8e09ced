"""Schemas with keywords the grammar engine would drop are refused, naming them (json_schema.py)."""

from __future__ import annotations

import json

import pytest

from kvflow.structured_output.backend import StructuredOutputError
from kvflow.structured_output.json_schema import describe_unenforced, unenforced_keywords
from kvflow.structured_output.manager import StructuredOutputManager
from kvflow.structured_output.params import StructuredOutputsParams


def found(schema: dict) -> list[tuple[str, str]]:
    return [(where, keyword) for where, keyword, _ in unenforced_keywords(schema)]


def test_finds_keywords_wherever_a_subschema_sits():
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "a/b": {"not": {"type": "null"}},
        "rows": {"type": "array", "items": {"type": "object", "propertyNames": {"pattern": "^x"}}}},
        "$defs": {"D": {"type": "array", "contains": {"const": 1}}}}
    assert found(schema) == [("/properties/tags", "uniqueItems"), ("/properties/a~1b", "not"),
                             ("/properties/rows/items", "propertyNames"), ("/$defs/D", "contains")]


def test_data_is_not_mistaken_for_keywords():
    """Property names, enum and const values and defaults are data: a property called "not" is fine."""
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"enum": [{"not": 1}]},
                                               "contains": {"const": {"uniqueItems": True}, "default": {"else": 2}}},
              "uniqueItems": False}
    assert found(schema) == []


def test_compositions_are_enforced_alone_not_beside_validation():
    pydantic_optional = {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Name"}
    pydantic_ref = {"allOf": [{"$ref": "#/$defs/C"}], "description": "a colour", "default": "red"}
    pydantic_tagged = {"oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}],
                       "discriminator": {"propertyName": "kind", "mapping": {"a": "#/$defs/A", "b": "#/$defs/B"}}}
    assert found(pydantic_optional) == [] and found(pydantic_ref) == [] and found(pydantic_tagged) == []
    assert found({"type": "object", "dependencies": {"a": ["b"]}}) == [("/", "dependencies")]  # draft 7's
    assert found({"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": -5}]}) == [("/", "anyOf")]
    assert found({"allOf": [{"type": "integer"}, {"minimum": 5}]}) == [("/", "allOf")]
    assert found({"oneOf": [{"type": "object", "required": ["a"], "if": {}}]}) == [("/oneOf/0", "if")]


def test_the_message_names_keyword_and_place():
    message = describe_unenforced({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    assert "'uniqueItems' at / (distinct array items)" in message and "xgrammar" in message
    assert describe_unenforced({"type": "object", "properties": {"a": {"type": "integer"}}}) is None


@pytest.fixture(scope="module")
def manager(smollm2_gguf) -> StructuredOutputManager:
    from kvflow.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smollm2_gguf)
    return StructuredOutputManager(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def test_compiling_refuses_before_xgrammar_drops_the_keyword(manager):
    """Measured: xgrammar 0.2.9 compiled this and let [3, 3, 1] through with finish_reason "stop"."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 3}, "minItems": 3,
              "maxItems": 3, "uniqueItems": True}
    for given in (schema, json.dumps(schema)):
        with pytest.raises(StructuredOutputError, match="'uniqueItems' at /") as err:
            manager.compile(StructuredOutputsParams(json=given))
        assert err.value.field == "json"
    del schema["uniqueItems"]
    manager.compile(StructuredOutputsParams(json=schema))  # the rest compiles
