"""SamplingParams' checks of what a Python caller passes: wrong types are a ValueError naming the
field (not a crash of a rank process that decodes the request, nor a silently different request),
and the spellings vLLM accepts (a single stop string, numpy numbers) mean what they say."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from tpserve.message import GenerateRequest
from tpserve.sampling_params import SamplingParams, StructuredOutput


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"max_tokens": 2.5}, "max_tokens must be an integer, got 2.5"),
        ({"max_tokens": True}, "max_tokens must be an integer, got True"),
        ({"top_k": 1.5}, "top_k must be an integer, got 1.5"),
        ({"top_k": "5"}, "top_k must be an integer, got '5'"),
        ({"min_tokens": 1.0}, "min_tokens must be an integer, got 1.0"),
        ({"seed": "7"}, "seed must be an integer, got '7'"),
        ({"logprobs": 1.5}, "logprobs must be an integer, got 1.5"),
        ({"prompt_logprobs": False}, "prompt_logprobs must be an integer, got False"),
        ({"temperature": "0.5"}, "temperature must be a number, got '0.5'"),
        ({"top_p": None}, "top_p must be a number, got None"),
        ({"repetition_penalty": True}, "repetition_penalty must be a number, got True"),
        ({"ignore_eos": "no"}, "ignore_eos must be True or False, got 'no'"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be True or False, got 1"),
        ({"stop": ["a", 3]}, "stop must be a string or a list of strings, got ['a', 3]"),
        ({"stop": 3}, "stop must be a string or a list of strings, got 3"),
        ({"stop_token_ids": [1, 2.0]}, "stop_token_ids must be a list of integers, got [1, 2.0]"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of integers, got 5"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias must map integer token ids to numbers, got {'5': 1.0}"),
        ({"logit_bias": {5: "big"}}, "logit_bias must map integer token ids to numbers, got {5: 'big'}"),
        ({"structured": "json_object"}, "structured must be a StructuredOutput, got 'json_object'"),
        ({"allowed_token_ids": [1, "2"]}, "allowed_token_ids must be a list of integers, got [1, '2']"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids must be token ids >= 0, got -1"),
        ({"bad_words": "word"}, "bad_words must be a list of strings, got 'word'"),
        ({"bad_words": [" "]}, "bad_words must not be empty or only spaces"),
        ({"bad_words": ["w"] * 65}, "bad_words may hold at most 64 words"),
        ({"bad_words_token_ids": [1, 2]}, "bad_words_token_ids must be a list of token-id lists, got [1, 2]"),
        ({"bad_words_token_ids": [[1], []]}, "bad_words_token_ids must not hold an empty token list"),
        ({"bad_words_token_ids": [[1, 2**63]]}, "bad_words_token_ids token id must be below 2**63"),
    ],
)
def test_wrong_types_are_value_errors_naming_the_field(kwargs, fragment):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert fragment in str(e.value)


@pytest.mark.parametrize(
    "stop, fragment",
    [
        ([str(i) for i in range(17)], "stop may hold at most 16 strings, got 17"),
        (["ok", "x" * 513], "stop strings must be at most 512 characters, got 513 (stop[1])"),
        ("é" * 513, "at most 512 characters, got 513 (stop[0])"),
    ],
)
def test_stop_strings_are_bounded(stop, fragment):
    assert SamplingParams(stop=[str(i) for i in range(16)]).stop == [str(i) for i in range(16)]
    assert SamplingParams(stop="x" * 512).stop == ["x" * 512]
    with pytest.raises(ValueError) as e:
        SamplingParams(stop=stop)
    assert fragment in str(e.value)


def test_stop_token_ids_are_bounded():
    """As the stop strings are: each generated token is looked up in them, and min_tokens bans them all."""
    assert SamplingParams(stop_token_ids=list(range(256))).stop_token_ids == list(range(256))
    with pytest.raises(ValueError) as e:
        SamplingParams(stop_token_ids=list(range(257)))
    assert "stop_token_ids may hold at most 256 token ids, got 257" in str(e.value)


def test_a_single_stop_string_is_one_stop_string():
    # vLLM's SamplingParams(stop="ab") stops at "ab"; iterated as characters it would stop at "a" or "b".
    assert SamplingParams(stop="ab").stop == ["ab"]
    assert SamplingParams(stop=("ab", "c")).stop == ["ab", "c"]
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        SamplingParams(stop="")


def test_numpy_numbers_are_plain_values_on_the_wire():
    """Requests go to the rank processes as msgpack (tp_size > 1): numpy scalars, which msgpack
    cannot encode, become ints and floats."""
    params = SamplingParams(
        temperature=np.float32(0.5), top_k=np.int64(3), max_tokens=np.int32(4), seed=np.uint64(9),
        stop_token_ids=[np.int64(5)], logit_bias={np.int64(7): np.float64(2.0)}, stop=np.str_("x"),
    )
    assert type(params.temperature) is float and type(params.top_k) is int and type(params.max_tokens) is int
    assert type(params.stop_token_ids[0]) is int and type(next(iter(params.logit_bias))) is int
    request = GenerateRequest(1, [1, 2], params)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=GenerateRequest)
    assert decoded.params == params


def test_integer_floats_are_still_refused_but_ints_are_taken_for_floats():
    assert SamplingParams(temperature=0, top_p=1).temperature == 0.0
    assert type(SamplingParams(temperature=0).temperature) is float
    with pytest.raises(ValueError, match="max_tokens must be an integer"):
        SamplingParams(max_tokens=16.0)


@pytest.mark.parametrize("name", ["n", "top_k", "max_tokens", "min_tokens", "priority"])
def test_integers_beyond_64_bits_are_refused_not_a_crash_on_the_wire(name):
    """msgpack carries at most 64-bit integers: a larger one made at tp_size > 1 (and in the server's
    shell) an OverflowError from deep inside the encoder, after the request was accepted."""
    kwargs = {name: 2**63, "max_tokens": None} if name == "min_tokens" else {name: 2**63}
    with pytest.raises(ValueError, match=rf"{name} must be below 2\*\*63, got {2**63}"):
        SamplingParams(**kwargs)
    request = GenerateRequest(1, [1], SamplingParams(**{**kwargs, name: 2**63 - 1}))
    msgspec.msgpack.encode(request)  # the largest accepted value travels
    if name == "priority":  # the one field that may be negative
        msgspec.msgpack.encode(GenerateRequest(1, [1], SamplingParams(priority=-2**63)))
        with pytest.raises(ValueError, match=r"priority must be in \[-2\*\*63, 2\*\*63\)"):
            SamplingParams(priority=-2**63 - 1)


@pytest.mark.parametrize("kind, spec", [("json_schema", 5), ("regex", None), ("ebnf", b"root ::= 'a'")])
def test_structured_output_of_the_wrong_type_names_it(kind, spec):
    """A spec that is not text failed in generate() inside the json module ("the JSON object must be str")."""
    with pytest.raises(ValueError, match=f"structured output spec must be a string, got {spec!r}"):
        StructuredOutput(kind, spec)


def test_bad_word_bans_follow_the_outputs_tail():
    """A bad word's last token is banned exactly where the output so far ends with its other tokens."""
    params = SamplingParams(bad_words_token_ids=[[7], [3, 4], [1, 3, 5]])
    assert params.bad_word_bans([]) == [7]
    assert params.bad_word_bans([9, 3]) == [7, 4]
    assert params.bad_word_bans([1, 3]) == [7, 4, 5]
    assert params.bad_word_bans([3, 1]) == [7]
    assert params.needs_output_history and not SamplingParams(bad_words_token_ids=[[7], [8]]).needs_output_history
    assert SamplingParams(bad_words_token_ids=[[7]]).edits_logits and SamplingParams(allowed_token_ids=[1]).edits_logits


def test_a_pooled_request_asks_for_no_generated_output():
    assert SamplingParams(pooling="embed").pooled and SamplingParams(pooling="classify").pooled
    assert not SamplingParams().pooled
    for task in ("embed", "classify"):
        for extra in ({"logprobs": 1}, {"prompt_logprobs": 0}, {"structured": StructuredOutput("json_object")}, {"n": 2}):
            with pytest.raises(ValueError, match=rf"a pooled request \({task}\)"):
                SamplingParams(pooling=task, **extra)
    for bad in ("reward", 1, True):
        with pytest.raises(ValueError, match="pooling must be one of embed, classify"):
            SamplingParams(pooling=bad)
