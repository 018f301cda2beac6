"""The limits grammar.py adds to a schema (six fraction digits, objects closed to unlisted keys) never refuse a
schema that has valid values, nor a value valid under it (found by review: allOf branches, narrow ranges)."""

import jsonschema
import pytest

from stowage.engine.text import grammar

ALL_OF = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
NARROW = {"type": "object", "properties": {"x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e-7}},
          "required": ["x"]}


@pytest.mark.parametrize("schema, value", [(ALL_OF, {"a": 1, "b": 2}), (NARROW, {"x": 5e-8})])
def test_a_schema_with_valid_values_keeps_them_once_bounded_and_compiles(schema, value):
    # before: each allOf branch was closed to the other's key, and (0, 1e-7] got multipleOf 1e-6: both a 400
    jsonschema.validate(value, schema)
    jsonschema.validate(value, grammar._bounded(schema))
    assert grammar.json_schema_grammar(schema)


def test_the_limits_still_apply_where_they_can():
    bounded = grammar._bounded({"type": "object", "properties": {"n": {"type": "number", "minimum": 0, "maximum": 1}},
                                "allOf": [{"properties": {"n": {"type": "number"}}}]})
    assert bounded["additionalProperties"] is False  # the object itself is closed, its allOf branch is not
    assert "additionalProperties" not in bounded["allOf"][0]
    assert bounded["properties"]["n"]["multipleOf"] == 10.0 ** -grammar.FRACTION_DIGITS
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"n": 0.5, "other": 1}, bounded)
