"""Structured output offline: JSON schema, regex, EBNF and json_object constrain a random-weight
model; neighbours in the batch are unaffected; overlap on and off agree."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tpserve import LLM, SamplingParams
from tpserve.sampling_params import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "sunny": {"type": "boolean"},
        "level": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["city", "sunny", "level", "tags"],
    "additionalProperties": False,
}


def params(structured: StructuredOutput | None, **kw) -> SamplingParams:
    return SamplingParams(temperature=kw.pop("temperature", 1.0), seed=kw.pop("seed", 3), max_tokens=kw.pop("max_tokens", 80),
                          structured=structured, **kw)


@pytest.fixture(scope="module", params=[False, True], ids=["overlap", "no-overlap"])
def llm(request, qwen3_dir):
    with LLM(qwen3_dir, device="cpu", disable_overlap=request.param) as llm:
        yield llm


def test_json_schema_regex_ebnf_are_followed(llm):
    cases = [
        StructuredOutput("json_schema", json.dumps(SCHEMA)),
        StructuredOutput("regex", r"(yes|no), [0-9]{2,4}!"),
        StructuredOutput("ebnf", 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "zz"'),
    ]
    plain = params(None, ignore_eos=True, max_tokens=20)
    alone = llm.generate([[5, 6, 7]], plain, use_tqdm=False)[0].token_ids
    outs = llm.generate([[5, 6, 7]] * 7, [params(c, seed=s) for c in cases for s in (1, 2)] + [plain],
                        use_tqdm=False)
    for out in outs[:2]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    for out in outs[2:4]:
        assert out.finish_reason == "stop" and re.fullmatch(r"(yes|no), [0-9]{2,4}!", out.text), out.text
    for out in outs[4:6]:
        assert out.finish_reason == "stop" and re.fullmatch(r"\((?:[a-c]|zz)(?:,(?:[a-c]|zz))*\)", out.text), out.text
    assert outs[6].token_ids == alone  # the unconstrained neighbour is unaffected


def test_structural_tags_are_followed(llm):
    """A structural tag (vLLM's response_format type, xgrammar's format): a tag around a JSON schema, in its current
    layout and in the older begin / schema / end one, and an error for a format xgrammar does not know."""
    point = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"],
             "additionalProperties": False}
    tagged = {"type": "structural_tag", "format": {"type": "tag", "begin": "<p>", "end": "</p>",
                                                   "content": {"type": "json_schema", "json_schema": point}}}
    outs = llm.generate([[5, 6, 7]] * 2, [params(StructuredOutput("structural_tag", json.dumps(tagged)), seed=s)
                                          for s in (1, 2)], use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop" and out.text.startswith("<p>") and out.text.endswith("</p>"), out.text
        jsonschema.validate(json.loads(out.text[3:-4]), point)
    older = {"type": "structural_tag", "structures": [{"begin": "<p>", "schema": point, "end": "</p>"}],
             "triggers": ["<p>"]}
    out = llm.generate([[5, 6, 7]], params(StructuredOutput("structural_tag", json.dumps(older)), max_tokens=200),
                       use_tqdm=False)[0]
    for body in re.findall(r"<p>(.*?)</p>", out.text, re.S):  # free text, but every tag holds the schema's JSON
        jsonschema.validate(json.loads(body), point)
    for bad, message in [
        ({"type": "structural_tag", "format": {"type": "nope"}}, "invalid structural_tag: .*nope"),
        ({**older, "structures": [{"begin": "<p>", "schema": point}]}, r"structures\[0\]\.end must be a string"),
        ({"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"const": 2**64 - 1}}},
         "the structural tag holds the integer 18446744073709551615"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate([[1]], params(StructuredOutput("structural_tag", json.dumps(bad))), use_tqdm=False)


def test_greedy_json_object_and_reproducible(llm):
    schema = StructuredOutput("json_schema", json.dumps(SCHEMA))
    a, b = llm.generate([[9, 10], [9, 10]], params(schema, temperature=0), use_tqdm=False)
    assert a.token_ids == b.token_ids
    jsonschema.validate(json.loads(a.text), SCHEMA)
    out = llm.generate([[9, 10]], params(StructuredOutput("json_object"), max_tokens=200, seed=5), use_tqdm=False)[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # a random model may write a long object; what it wrote is still an object's start
        assert out.text.startswith("{")


def test_invalid_spec_is_a_value_error(llm):
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate([[1]], params(StructuredOutput("regex", "(unclosed")), use_tqdm=False)
    with pytest.raises(ValueError, match="not valid JSON"):
        llm.generate([[1]], params(StructuredOutput("json_schema", "{bad")), use_tqdm=False)


@pytest.mark.parametrize("ebnf, after", [("root ::= root", 0), ('root ::= "a" rest\nrest ::= rest', 1)],
                         ids=["no-output", "dead-end"])
def test_a_grammar_that_allows_no_token_is_an_error_not_text_it_forbids(llm, ebnf, after):
    """A grammar that accepts no output, or none past its first token: the request fails naming where, the engine
    goes on. Also where the dead end's position is a page's last (16 tokens a page): under overlap the next step had
    counted that position, and giving the request's pages to the prefix cache failed."""
    for prompt in ([1], list(range(1, 16 - after))):
        with pytest.raises(ValueError, match=f"the ebnf constraint allows no token after {after} generated tokens"):
            llm.generate([prompt], params(StructuredOutput("ebnf", ebnf), temperature=0.0), use_tqdm=False)
    out = llm.generate([[1]], params(StructuredOutput("regex", "[ab]{3}"), temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[ab]{3}", out.text)


def test_min_tokens_holds_the_end_back_only_where_the_grammar_allows_more(llm):
    """min_tokens bans the end until then; a grammar that allows only the end before that is an error, not tokens
    both forbid (every logit was -inf, and token 0 was emitted)."""
    out = llm.generate([[1]], params(StructuredOutput("regex", "[ab]+"), temperature=0.0, min_tokens=4, max_tokens=10),
                       use_tqdm=False)[0]
    assert re.fullmatch("[ab]+", out.text) and len(out.token_ids) >= 4, out.text
    with pytest.raises(ValueError, match="allows only the end after 2 generated tokens, but min_tokens is 4"):
        llm.generate([[1]], params(StructuredOutput("regex", "[ab]{2}"), temperature=0.0, min_tokens=4), use_tqdm=False)


def test_a_schema_nested_too_deep_is_refused_before_it_is_parsed(llm):
    schema: dict = {"type": "string"}
    for _ in range(130):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match="nested 131 levels deep; at most 128"):
        llm.generate([[1]], params(StructuredOutput("json_schema", json.dumps(schema))), use_tqdm=False)


def test_a_grammar_that_compiles_too_long_fails_then_serves_from_the_cache(qwen3_dir):
    """Past --grammar-compile-timeout the request fails; the compile goes on, so the same spec asked again once it is
    done is served at once."""
    spec = StructuredOutput("regex", "[ab]{2,9}c")
    with LLM(qwen3_dir, device="cpu", grammar_compile_timeout=1e-6) as llm:
        with pytest.raises(ValueError, match=r"its regex did not compile within 1e-06 s \(--grammar-compile-timeout\)"):
            llm.generate([[1]], params(spec, temperature=0.0), use_tqdm=False)
        future = llm._driver.scheduler.compiling.compiler.submit(spec)
        future.result()
        out = llm.generate([[1]], params(spec, temperature=0.0), use_tqdm=False)[0].outputs[0]
        assert re.fullmatch("[ab]{2,9}c", out.text)


def test_json_grammars_never_take_control_character_tokens(qwen3_dir):
    """JSON (and so every client's parser) rejects raw control characters in strings, which
    xgrammar's length-limited strings take; tpserve's JSON vocabulary leaves those tokens out and
    changes nothing else. The tiny vocabulary has all 32 of them as single-byte tokens."""
    import xgrammar as xgr

    from tpserve.config import ModelConfig
    from tpserve.structured.grammar import _grammar, json_tokenizer_info
    from tpserve.structured.mask import unpack_bitmask
    from tpserve.tokenizer.loader import load_tokenizer

    config = ModelConfig.from_pretrained(qwen3_dir)
    vocab = config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(qwen3_dir), vocab_size=vocab,
                                              stop_token_ids=list(config.eos_token_ids))
    control = torch.tensor([any(b < 0x20 for b in text) for text in info.decoded_vocab])
    assert control.sum() >= 32
    compilers = {"plain": xgr.GrammarCompiler(info), "json": xgr.GrammarCompiler(json_tokenizer_info(info))}
    cases = [("json_schema", json.dumps(SCHEMA), '{"city": "'), ("json_object", "", '{"k": "'),
             ("json_schema", json.dumps(SCHEMA), '{"city": "ab", "sunny": true, "level": 1')]
    plain_takes_some = False
    for kind, spec, prefix in cases:
        allowed = {}
        for name, compiler in compilers.items():
            matcher = xgr.GrammarMatcher(compiler.compile_grammar(_grammar(StructuredOutput(kind, spec))))
            assert matcher.accept_string(prefix)
            mask = xgr.allocate_token_bitmask(1, vocab)
            matcher.fill_next_token_bitmask(mask)
            allowed[name] = unpack_bitmask(mask, vocab)[0]
        assert not (allowed["json"] & control).any(), (kind, prefix)
        assert torch.equal(allowed["json"], allowed["plain"] & ~control), (kind, prefix)
        plain_takes_some |= bool((allowed["plain"] & control).any())
    assert plain_takes_some, "xgrammar no longer takes them: the JSON vocabulary can go"


def test_batched_matchers_equal_one_by_one(llm):
    import xgrammar as xgr

    from tpserve.structured.grammar import GrammarCompiler, MaskFiller, new_matcher

    vocab = llm.model_config.vocab_size
    compiler = GrammarCompiler(llm.config.model, vocab, list(llm.model_config.eos_token_ids))
    compiled = compiler.submit(StructuredOutput("json_schema", json.dumps(SCHEMA))).result()
    matchers = [new_matcher(compiled) for _ in range(12)]
    for i, m in enumerate(matchers):  # different states: each has accepted a different prefix
        assert m.accept_string('{"city": "' + "ab"[: i % 3])
    rows = [2 * i + 1 for i in range(12)]  # the constrained rows of a batch of 25
    filler = MaskFiller(vocab)
    batched = filler.fill(matchers, rows, 25).clone()
    single = xgr.allocate_token_bitmask(25, vocab)
    for row, m in zip(rows, matchers):
        m.fill_next_token_bitmask(single, row)
    assert (batched[rows] == single[rows]).all()
    assert filler.fill(matchers[:3], rows[:3], 7).shape == (7, single.shape[1])  # the buffer is reused

    twins = [new_matcher(compiled) for _ in range(12)]
    for m, t in zip(matchers, twins):
        t.accept_string('{"city": "')
        m.reset()
        m.accept_string('{"city": "')
    tokens = list(range(100, 112))
    assert filler.accept(matchers, tokens) == [t.accept_token(tok) for t, tok in zip(twins, tokens)]
    compiler.close()


def test_tp2_ranks_agree_with_tp1(qwen3_dir):
    """Each rank process compiles the grammar and watches the stop strings itself."""
    regex = StructuredOutput("regex", r"(yes|no) [0-9]{2}")
    ps = [SamplingParams(temperature=0.8, seed=i, max_tokens=60, structured=regex, repetition_penalty=1.2,
                         stop=["9"]) for i in range(4)]
    results = {}
    for tp in (1, 2):
        with LLM(qwen3_dir, tp_size=tp, device="cpu") as llm:
            results[tp] = [(o.text, o.finish_reason) for o in llm.generate([[5, 6, 7]] * 4, ps, use_tqdm=False)]
    assert results[1] == results[2]
    assert all(reason == "stop" and re.fullmatch(r"(yes|no) [0-8]{0,2}", text) for text, reason in results[2])


def test_compile_failure_fails_the_request_not_the_scheduler(llm):
    from concurrent.futures import Future

    from tpserve.scheduler.request import Request

    scheduler = llm._driver.scheduler
    failed: Future = Future()
    failed.set_exception(OSError("no tokenizer files"))
    spec = StructuredOutput("regex", "a")
    scheduler.compiling.compiler._cache[spec.key] = failed
    scheduler.compiling.add(999, Request(999, [1, 2], params(spec), 0, 4), spec)
    assert scheduler.grammars_ready() == [(999, False)]
    (out,) = scheduler.attach_grammar(999)
    assert out.finish_reason == "error" and "no tokenizer files" in out.error and not scheduler.compiling


def test_an_abort_drops_a_compile_not_started_that_no_other_request_waits_for(llm):
    import threading

    from tpserve.structured.grammar import COMPILE_THREADS

    scheduler = llm._driver.scheduler
    compiler = scheduler.compiling.compiler
    gate = threading.Event()
    for _ in range(COMPILE_THREADS):  # every compile thread busy: the next compile waits
        compiler._pool.submit(gate.wait)
    try:
        p = params(StructuredOutput("regex", "[xy]{4}q"))
        scheduler.add_request(900, [1, 2], p, seed=0)
        scheduler.add_request(901, [1, 2], p, seed=0)
        future = scheduler.compiling.compile_of(900)
        assert scheduler.compiling.compile_of(901) is future  # one compile for both
        assert scheduler.stats().waiting == 2  # requests compiling their grammar count as waiting in /metrics
        assert scheduler.abort(900) and not future.cancelled()  # 901 still waits for it
        assert scheduler.abort(901) and future.cancelled() and not scheduler.compiling
        assert compiler.submit(p.structured) is not future  # asked for again, it is compiled afresh
    finally:
        gate.set()


def test_an_aborted_compile_is_forgotten_once_started_too(llm):
    """Whether an abort found the compile started depends on each rank's timing: kept by one rank and dropped by
    another, a retry was ready at once on the first while the second compiled it, holding every rank's step."""
    import time

    scheduler = llm._driver.scheduler
    p = params(StructuredOutput("regex", "[xy]{5}r"))
    scheduler.add_request(910, [1, 2], p, seed=0)
    future = scheduler.compiling.compile_of(910)
    while not scheduler.grammars_ready():
        time.sleep(0.01)
    assert scheduler.abort(910) and future.done() and not future.cancelled()
    assert scheduler.compiling.compiler.submit(p.structured) is not future
