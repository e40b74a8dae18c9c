"""``check_spec``: what the tokenizer workers refuse before a grammar is compiled."""

from __future__ import annotations

import json

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
