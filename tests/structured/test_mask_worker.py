"""The mask worker: the matchers' accept and fill run on a thread of their own while the main
thread launches the step's forward and processes the previous step. Slowed down so that a fill
is in flight while requests finish, it must give the same tokens as the same work done inline."""

from __future__ import annotations

import json
import threading
import time

import jsonschema
import pytest

from tpserve import LLM, SamplingParams
from tpserve.sampling_params import StructuredOutput
from tpserve.scheduler.scheduler import Scheduler
from tpserve.structured.worker import MaskWorker

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
JSON = StructuredOutput("json_schema", json.dumps(SCHEMA))
REGEX = StructuredOutput("regex", r"(yes|no)-[0-9]{1,6}")


def slow_worker(scheduler: Scheduler, threaded: bool) -> list[str]:
    """Swap in a worker whose fills take 5 ms longer; returns the names of the threads that filled."""
    filler = scheduler.masks.filler
    scheduler.masks.close()
    scheduler.masks = MaskWorker(filler, sorted(scheduler.eos_ids), threaded=threaded)
    fill, threads = filler.fill, []

    def slow_fill(*args, **kwargs):
        threads.append(threading.current_thread().name)
        time.sleep(0.005)
        return fill(*args, **kwargs)

    filler.fill = slow_fill  # type: ignore[method-assign]
    return threads


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_worker_thread_equals_inline_while_requests_finish(qwen3_dir, overlap):
    prompts = [[3 + i, 4, 5 + i] * (1 + i % 3) for i in range(10)]
    params = []
    for i in range(10):
        spec = (JSON, REGEX, None)[i % 3]
        # greedy and sampled; short max_tokens so requests finish by length while others go on
        params.append(SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=(6, 40, 13, 60)[i % 4],
                                     structured=spec, ignore_eos=spec is None))
    results = {}
    for threaded in (True, False):
        with LLM(qwen3_dir, device="cpu", disable_overlap=not overlap) as llm:
            threads = slow_worker(llm._driver.scheduler, threaded)
            results[threaded] = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert threads and set(threads) == ({"tpserve-masks_0"} if threaded else {"MainThread"})
    assert results[True] == results[False]
    reasons = {reason for _, reason in results[True]}
    assert reasons == {"stop", "length"}  # some ended by their grammar, some by max_tokens


def run(scheduler: Scheduler, requests: dict[int, SamplingParams], abort_at: int | None) -> dict[int, list[int]]:
    """Drive the scheduler as its loop does; abort request 0 after step ``abort_at``."""
    for rid, p in requests.items():
        scheduler.add_request(rid, [7, 8, 9 + rid], p, seed=rid)
    for rid in requests:
        if rid in scheduler.compiling:
            scheduler.compiling.compile_of(rid).result()
            assert scheduler.attach_grammar(rid) == []
    tokens: dict[int, list[int]] = {rid: [] for rid in requests}
    steps = 0
    while scheduler.has_work:
        for out in scheduler.step():
            tokens[out.rid] += out.token_ids
        steps += 1
        if steps == abort_at:
            assert scheduler.abort(0)
    return tokens


def test_abort_with_a_fill_pending_leaves_the_others_correct(qwen3_dir):
    """Request 0 is aborted between steps while its sampled token is still to be accepted and
    the step launched after it holds its row; the rows after it shift in the next step."""
    requests = {rid: SamplingParams(temperature=0.8, seed=rid, max_tokens=60, structured=JSON) for rid in range(6)}
    results = {}
    for threaded in (True, False):
        with LLM(qwen3_dir, device="cpu") as llm:
            slow_worker(llm._driver.scheduler, threaded)
            results[threaded] = run(llm._driver.scheduler, requests, abort_at=4)
            tokenizer = llm.tokenizer
    assert results[True] == results[False]
    assert 0 < len(results[True][0]) < 6  # aborted early
    for rid in range(1, 6):
        jsonschema.validate(json.loads(tokenizer.decode(results[True][rid], skip_special_tokens=True)), SCHEMA)


def test_termination_is_tracked_as_xgrammar_has_it(qwen3_dir):
    """The worker tracks which grammars have ended (accepted a stop token) instead of asking
    each matcher every step; it must agree with xgrammar, which fails a fill after the end."""
    from tpserve.config import ModelConfig
    from tpserve.structured.grammar import GrammarCompiler, MaskFiller, RequestGrammar, new_matcher
    from tpserve.structured.worker import SampledRows
    from tpserve.tokenizer.loader import load_tokenizer

    config = ModelConfig.from_pretrained(qwen3_dir)
    eos = sorted(config.eos_token_ids)
    compiler = GrammarCompiler(qwen3_dir, config.vocab_size, eos)
    compiled = compiler.submit(StructuredOutput("regex", "a(b|bc)")).result()
    compiler.close()
    tokenizer = load_tokenizer(qwen3_dir)
    a, b, c = (tokenizer.encode(ch, add_special_tokens=False) for ch in "abc")
    assert len(a) == len(b) == len(c) == 1
    walks = [a + b + [eos[0]], a + b + c]  # the first ends; the second could still take c's end
    grammars = [RequestGrammar(new_matcher(compiled)) for _ in walks]
    worker = MaskWorker(MaskFiller(config.vocab_size), eos, threaded=False)
    for step in range(3):
        job = worker.submit(list(enumerate(grammars)), 2).result()
        masks = job.masks
        assert job.dead_rows == []
        assert masks is not None and masks.shape[0] == 2 and not (masks == -1).all(dim=1).any()  # both masked
        tokens = [walk[step] for walk in walks]
        worker.sampled(SampledRows(lambda tokens=tokens: tokens, [(row, row, g) for row, g in enumerate(grammars)]))
    masks = worker.submit(list(enumerate(grammars)), 2).result().masks  # accepts the last tokens, then fills
    assert [g.terminated for g in grammars] == [g.matcher.is_terminated() for g in grammars] == [True, False]
    # the ended grammar's row allows every token (no mask), the other's is its grammar's
    assert masks is not None and (masks[0] == -1).all() and not (masks[1] == -1).all()
    worker.close()


def test_a_grammar_with_no_token_to_allow_is_a_dead_end_row(qwen3_dir):
    """``root ::= root`` compiles but allows no token: its row is reported (and left unmasked, so that sampling it
    is defined) where an ordinary grammar's row beside it is masked; the worker never fills the dead one again."""
    from tpserve.config import ModelConfig
    from tpserve.structured.grammar import GrammarCompiler, MaskFiller, RequestGrammar, new_matcher

    config = ModelConfig.from_pretrained(qwen3_dir)
    eos = sorted(config.eos_token_ids)
    compiler = GrammarCompiler(qwen3_dir, config.vocab_size, eos)
    empty = compiler.submit(StructuredOutput("ebnf", "root ::= root")).result()
    regex = compiler.submit(REGEX).result()
    compiler.close()
    grammars = [RequestGrammar(new_matcher(regex)), RequestGrammar(new_matcher(empty))]
    worker = MaskWorker(MaskFiller(config.vocab_size), eos, threaded=False)
    step = worker.submit(list(enumerate(grammars)), 2).result()
    assert step.dead_rows == [1] and [g.dead_end for g in grammars] == [False, True]
    assert not (step.masks[0] == -1).all() and (step.masks[1] == -1).all()
    assert worker.submit(list(enumerate(grammars)), 2).result().dead_rows == []  # reported once
    worker.close()
