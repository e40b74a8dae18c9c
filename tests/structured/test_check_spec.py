"""``check_spec``: what the tokenizer workers refuse before a grammar is compiled."""

from __future__ import annotations

import json
import re

import pytest

from tpserve.sampling_params import StructuredOutput
from tpserve.structured.grammar import InvalidGrammar, check_spec


@pytest.mark.parametrize("schema", [{"const": 2**64 - 1}, {"enum": [1, 12345678901234567890]},
                                    {"type": "object", "properties": {"n": {"const": -(2**63) - 1}}}])
def test_integers_past_int64_in_a_schema_are_refused(schema):
    """(review) xgrammar holds a schema's integers as doubles: a const of 2**64 - 1 came out as
    1.8446744073709552e+19 with finish "stop"."""
    with pytest.raises(InvalidGrammar, match="past the 64-bit signed range"):
        check_spec(StructuredOutput("json_schema", json.dumps(schema)))


def test_integers_within_int64_pass():
    check_spec(StructuredOutput("json_schema", json.dumps({"enum": [2**63 - 1, -(2**63), 7]})))


def _accepts(schema: dict, text: str) -> bool:
    """Whether the grammar tpserve compiles for ``schema`` accepts ``text`` whole."""
    from xgrammar.testing import _is_grammar_accept_string

    from tpserve.structured.grammar import _grammar

    return _is_grammar_accept_string(_grammar(StructuredOutput("json_schema", json.dumps(schema))), text)


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "number", "multipleOf": 7}, "multipleOf"),  # xgrammar took 3 and 3.5
    ({"type": "integer", "multipleOf": 2.5}, "multipleOf"),
    ({"multipleOf": 7}, "multipleOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),  # took [1, 1]
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}, "maxContains": 1}, "contains"),
    ({"type": "object", "properties": {"v": {"not": {"type": "string"}}}, "required": ["v"]}, "not"),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "if"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
     "dependentRequired"),
    ({"allOf": [{"type": "integer"}, {"maximum": 3}]}, "allOf"),  # took 5
    ({"type": "string", "minLength": 2, "pattern": "^a+$"}, "minLength"),  # took "a"
    ({"type": "string", "maxLength": 3, "format": "email"}, "maxLength"),
    ({"$defs": {"s": {"type": "array", "uniqueItems": True}}, "$ref": "#/$defs/s"}, "uniqueItems"),
])
def test_schema_keywords_the_grammar_does_not_enforce_are_refused(schema, keyword):
    """(review) xgrammar parses these keywords and ignores them: a request's answer ended "stop" with JSON its
    schema refuses (multipleOf 7: -9E58817). Refused as vLLM's xgrammar backend refuses them."""
    with pytest.raises(InvalidGrammar, match=f"uses '{keyword}'.*does not enforce"):
        check_spec(StructuredOutput("json_schema", json.dumps(schema)))


@pytest.mark.parametrize("schema", [
    {"type": "integer", "multipleOf": 7},
    {"type": "array", "uniqueItems": False},
    {"type": "object", "properties": {"not": {"type": "string"}, "if": {"allOf": [{"type": "integer"}]}}},
    {"enum": [{"uniqueItems": True}]},  # data, not a schema
    {"type": "string", "maxLength": 3},
])
def test_keywords_the_grammar_enforces_pass(schema):
    check_spec(StructuredOutput("json_schema", json.dumps(schema)))


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "object", "required": ["a"]}, '{"a": 1}', "{}"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, '{"a": 1, "b": "x"}',
     '{"a": 1}'),
    ({"type": "object", "required": ["a"], "additionalProperties": {"type": "integer"}}, '{"a": 1}', '{"a": "x"}'),
    ({"type": "array", "items": {"type": "object", "required": ["a"]}}, '[{"a": null}]', "[{}]"),
])
def test_required_names_left_out_of_properties_are_required(schema, good, bad):
    """(review) In strict mode xgrammar dropped a required name that ``properties`` does not list: the output was
    ``{}`` (finish "stop") for {"type": "object", "required": ["a"]}."""
    check_spec(StructuredOutput("json_schema", json.dumps(schema)))
    assert _accepts(schema, good) and not _accepts(schema, bad)


@pytest.mark.parametrize("schema, keyword", [
    ({"minimum": 5}, "'minimum' in a schema without a 'type'"),  # took 3
    ({"maxLength": 2}, "'maxLength' in a schema without a 'type'"),  # took a long string
    ({"format": "uuid"}, "'format' in a schema without a 'type'"),  # took ""
    ({"type": "integer", "anyOf": [{"minimum": 5}]}, "'minimum' in a schema without a 'type'"),  # took 0
    ({"type": "object", "properties": {"zz": {"type": "integer"}}, "propertyNames": {"pattern": "^[a-c]+$"}},
     "'propertyNames' beside 'properties'"),  # took {"zz": 1}
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}, "properties": {"b": {"type": "string"}}},
     "'patternProperties' of more than one pattern, or beside 'properties'"),
    ({"type": "string", "format": "idn-email"}, "the string format 'idn-email'"),  # took ""
    ({"type": "integer", "exclusiveMaximum": 3, "multipleOf": 5}, "'multipleOf' with a bound on one side only"),  # -24
])
def test_keywords_xgrammar_ignores_there_are_refused(schema, keyword):
    """(review, fuzzing) xgrammar parses these and ignores them: outputs finished "stop" breaking the schema."""
    with pytest.raises(InvalidGrammar, match=f"uses {re.escape(keyword)}.*does not enforce"):
        check_spec(StructuredOutput("json_schema", json.dumps(schema)))


@pytest.mark.parametrize("schema", [
    {"type": "object", "propertyNames": {"pattern": "^[a-c]+$"}},
    {"type": "object", "patternProperties": {"^a": {"type": "integer"}}},
    {"type": "integer", "format": "int64"},  # OpenAPI's: not a string format
    {"type": ["string", "null"], "format": "uuid"},
    {"type": "object", "properties": {"a": {"type": "integer"}}},
])
def test_their_held_forms_pass(schema):
    check_spec(StructuredOutput("json_schema", json.dumps(schema)))


@pytest.mark.parametrize("pattern", ['^"$', r"^\x22$", r"^a\\b$", r"^a\nb$"])
def test_a_pattern_that_needs_an_escaped_character_is_refused(pattern):
    """(review, fuzzing) xgrammar wrote such a pattern's characters unescaped: ``^"$`` finished "stop" with the string
    ``\"\"\"``, not JSON."""
    with pytest.raises(InvalidGrammar, match="needs a character that a JSON string must escape"):
        check_spec(StructuredOutput("json_schema", json.dumps({"type": "string", "pattern": pattern})))


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "string", "pattern": "^.é$"}, '"aé"', '""é"'),  # gave '""é"': a pattern not all ASCII went unescaped
    ({"type": "string", "pattern": r"^[^a]\é{1,2}$"}, '"bé"', '"\\é"'),
    ({"type": "object", "patternProperties": {"^ü.$": {"type": "integer"}}}, '{"üx": 1}', '{"ü"": 1}'),
    ({"type": "string", "format": "ipv4"}, '"10.0.255.1"', '"031.030.43.68"'),  # RFC 2673: no leading zero
    ({"type": "string", "format": "date"}, '"2024-02-29"', '"2023-02-29"'),
    ({"type": "string", "format": "date"}, '"2000-02-29"', '"2021-04-31"'),
])
def test_patterns_and_formats_hold_inside_a_json_string(schema, good, bad):
    check_spec(StructuredOutput("json_schema", json.dumps(schema)))
    assert _accepts(schema, good) and not _accepts(schema, bad)
