"""The limits grammar.py adds to a schema (six fraction digits, objects closed to unlisted keys) never refuse a
schema that has valid values, nor a value valid under it (found by review: allOf branches, narrow ranges)."""

import jsonschema
import pytest

from stowage.engine.errors import InvalidArgumentError
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
    bounded = grammar._bounded({"type": "object", "properties": {"n": {"type": "number", "minimum": 0, "maximum": 1}}})
    assert bounded["additionalProperties"] is False  # an object that lists its keys and nothing else is closed
    assert "additionalProperties" not in grammar._bounded(ALL_OF)["allOf"][0]  # an allOf branch is not
    assert bounded["properties"]["n"]["multipleOf"] == 10.0 ** -grammar.FRACTION_DIGITS
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"n": 0.5, "other": 1}, bounded)


@pytest.mark.parametrize("schema, value", [
    # review: a sibling allOf/anyOf/$ref adds keys the node itself does not list (before: each closed, a 400)
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "allOf": [{"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, {"a": 1, "b": 2}),
    ({"type": "object", "properties": {"kind": {"enum": ["x", "y"]}}, "required": ["kind"],
      "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]}]}, {"kind": "x", "x": 3}),
    ({"$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
      "allOf": [{"$ref": "#/$defs/base"}], "properties": {"name": {"type": "string"}}, "required": ["name"]},
     {"id": 1, "name": "n"}),
])
def test_schemas_whose_keys_or_bounds_come_from_elsewhere_compile(schema, value):
    jsonschema.validate(value, schema)
    jsonschema.validate(value, grammar._bounded(schema))
    assert grammar.json_schema_grammar(schema)


def test_a_bound_past_floats_range_is_a_clear_refusal_not_a_crash():
    # review: 1e308 / 1e-6 is inf, and math.ceil(inf) an OverflowError: a 500 with a traceback
    schema = {"type": "number", "minimum": 1e308}
    assert "multipleOf" not in grammar._bounded(schema)
    with pytest.raises(InvalidArgumentError, match="not supported"):  # llguidance's own limit: the server's 400
        grammar.json_schema_grammar(schema)
