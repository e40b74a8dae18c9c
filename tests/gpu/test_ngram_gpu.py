"""Speculative decoding with n-gram drafts on a GPU (CPU: tests/scheduler/test_ngram.py): a drafted step runs in a
decode CUDA graph, a row a token (``engine/batch.py`` ``one_token_rows``; eagerly as a chunk a sequence through
FlashInfer's prefill where the graphs are too small), between plain decode steps; float32 tokens and
log-probabilities equal the plain engine's, while drafts are both accepted and rejected."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

import json

from engine_scenario import assert_logits_close, drafted_step_logits
from tpserve import LLM, SamplingParams
from tpserve.engine.engine import Engine
from tpserve.engine_config import EngineConfig

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = [[i, i + 1, i + 2] for i in range(1, 200, 23)]


@pytest.fixture(scope="module")
def loopy_dir(tiny_model_factory, tmp_path_factory) -> str:
    from loopy_model import loopy_model

    source = tiny_model_factory("qwen3", head_dim=128, hidden_size=256, vocab_size=700)  # FlashInfer's head_dim
    return loopy_model(source, tmp_path_factory.mktemp("loopy") / "model")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_drafts_on_cuda_give_the_plain_engines_tokens(loopy_dir, dtype):
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, logprobs=0)
    runs = []
    for spec in (None, SPEC):
        kwargs = {} if spec is None else {"speculative_config": spec}
        with LLM(loopy_dir, device="cuda", dtype=dtype, **kwargs) as llm:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            stats = llm.replica_stats()[0]
        runs.append((outs, stats))
    (plain, _), (drafted, stats) = runs
    assert 10 < stats.accepted_tokens_total < stats.draft_tokens_total, stats
    if dtype == "float32":
        assert [d.outputs[0].token_ids for d in drafted] == [p.outputs[0].token_ids for p in plain]
        worst = max(abs(a - b) for p, d in zip(plain, drafted) for a, b in zip(p.token_logprobs, d.token_logprobs))
        assert worst < 1e-3, worst
        return
    # bf16: a drafted chunk's logits round otherwise than a graph's decode (6 of 9 texts equal on an H100): each text
    # is the plain one's until a near tie, where the two chosen tokens' log-probabilities are within bf16 noise
    for p, d in zip(plain, drafted):
        ours, theirs = d.outputs[0].token_ids, p.outputs[0].token_ids
        split = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if split is not None:
            gap = abs(d.token_logprobs[split] - p.token_logprobs[split])
            assert split > 0 and gap < 0.1, (split, gap)


@pytest.mark.parametrize("decode_attention,kv_cache_dtype", [("auto", "auto"), ("flashinfer", "auto"),
                                                             ("auto", "fp8_e4m3")])
def test_a_drafted_step_runs_in_a_decode_graph(tiny_model_factory, decode_attention, kv_cache_dtype):
    """bf16 with CUDA graphs: the drafted step replays a decode graph (its logits are those of its rows replayed, to the
    bit) and agrees with the same step run eagerly, a chunk a sequence, within bf16's kernel-to-kernel rounding. The
    rows run Triton's decode kernel (``auto``), whose keys read before the PDL wait must leave out the step's own, the
    decode wrapper, and XQA over FP8 pages (``auto``), launched without PDL here (it reads older tiles before its wait).
    The prompts' lengths (up to 80) put some drafted steps across a 64-key tile. XQA's FP8 math (q and the softmax
    weights in e4m3) moves this random model's logits far from the chunk's (FA2, bf16 math over the same FP8 pages;
    session 53: 0.18 relative), so there the rows that attend to keys of earlier rows of the step are held to the
    rows that attend to the cache and their own key only, which a plain decode step's rows are."""
    model = tiny_model_factory("qwen3", head_dim=128, hidden_size=256, vocab_size=700)
    config = EngineConfig(model=model, device="cuda", dtype="bfloat16", max_total_tokens=4096,
                          decode_attention=decode_attention, kv_cache_dtype=kv_cache_dtype,
                          speculative_config=json.dumps(SPEC))
    engine = Engine(config)
    try:
        assert engine.graph_runner is not None and engine.rows_per_sequence == 5
        table_kernel = engine.attention.table_decode
        if kv_cache_dtype == "fp8_e4m3":
            assert table_kernel.name == "XQA" and not table_kernel.pdl
        drafts = [4, 0, 3, 4, 1, 2, 4, 4]
        as_run, as_rows, chunked = drafted_step_logits(engine, drafts)
        assert torch.equal(as_run, as_rows)
        if kv_cache_dtype == "auto":
            assert_logits_close([as_rows], [chunked])
            return
        # each logits row's place in its sequence's step: the last tokens' rows, then each sequence's drafts' positions
        places = torch.tensor(drafts + [i for n in drafts for i in range(n)], device=chunked.device)
        errors = (as_rows - chunked).norm(dim=-1) / chunked.norm(dim=-1)
        alone, after = errors[places == 0], errors[places > 0]
        print(f"XQA rows vs the chunk: median row error {float(alone.median()):.3f} attending to the cache alone, "
              f"{float(after.median()):.3f} to earlier rows too")
        assert torch.isfinite(as_rows).all() and float(after.median()) < 1.5 * float(alone.median()) + 0.02
    finally:
        engine.shutdown()
