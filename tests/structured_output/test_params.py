"""StructuredOutputsParams and SamplingParams.structured_outputs: checked at construction, messages naming the field."""

from __future__ import annotations

import pytest

from kvflow import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "got none"),
    ({"json": {"type": "object"}, "regex": "a+"}, "exactly one kind of constraint, got json, regex"),
    ({"choice": ["a"], "json_object": True}, "got choice, json_object"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON schema object"),
    ({"json": 7}, "structured_outputs.json must be a JSON schema object"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"json_object": False}, "got none"),
    ({"regex": 5}, "structured_outputs.regex must be a non-empty string"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "structured_outputs.choice must be a non-empty list of non-empty strings"),
    ({"choice": "ab"}, "structured_outputs.choice must be a non-empty list"),
    ({"grammar": "   "}, "structured_outputs.grammar must be a non-empty EBNF string"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be true or false"),
    ({"json_object": True, "disable_any_whitespace": 1}, "disable_any_whitespace must be true or false"),
])
def test_invalid_constraints_are_refused_with_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        StructuredOutputsParams(**kwargs)


def test_kind_and_cache_key():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    as_dict, as_text = StructuredOutputsParams(json=schema), StructuredOutputsParams(json=str(schema).replace("'", '"'))
    assert as_dict.kind == as_text.kind == "json"
    assert as_dict.cache_key() == as_text.cache_key() and as_dict == as_text  # same grammar, however spelled
    # key order is part of the grammar (it is the order of the output's keys): a different key
    reordered = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"},
                                                                               "b": {"type": "integer"}}})
    assert reordered.cache_key() != as_dict.cache_key()
    assert StructuredOutputsParams(json=schema, disable_any_whitespace=False).cache_key() != as_dict.cache_key()
    assert StructuredOutputsParams(choice=("x", "y")).choice == ["x", "y"]
    assert StructuredOutputsParams(choice=["x", "y"]).cache_key() != StructuredOutputsParams(choice=["y", "x"]).cache_key()
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(regex="a+").cache_key() == ("regex", "a+", False)
    assert len({StructuredOutputsParams(regex="a+"), StructuredOutputsParams(regex="a+")}) == 1  # hashable


def test_sampling_params_carry_and_check_it():
    so = StructuredOutputsParams(regex="[0-9]+")
    p = SamplingParams(structured_outputs=so, max_tokens=8)
    assert p.structured_outputs is so and "structured_outputs" in p.explicit_fields
    assert SamplingParams(structured_outputs={"choice": ["yes", "no"]}).structured_outputs == \
        StructuredOutputsParams(choice=["yes", "no"])
    assert SamplingParams().structured_outputs is None
    # model defaults never touch it
    assert p.with_defaults({"temperature": 0.2}).structured_outputs is so
    with pytest.raises(ValueError, match="structured_outputs: unknown field.*structural_tag"):
        SamplingParams(structured_outputs={"structural_tag": "x"})
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="[0-9]+")
    with pytest.raises(ValueError, match="min_tokens must be 0 with structured_outputs"):
        SamplingParams(structured_outputs=so, min_tokens=2)
