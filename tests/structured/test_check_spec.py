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
