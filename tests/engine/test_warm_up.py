"""The prefill warm-up at engine start (``Engine._warm_up_prefill``, run on CUDA): which prompt lengths it runs,
and that running it leaves the engine's answers as they were (it writes KV pages no request holds yet)."""

from __future__ import annotations

import torch

from engine_scenario import prompts_for, run_scenario
from tpserve.engine.engine import Engine, prefill_warm_up_sizes
from tpserve.engine_config import EngineConfig
from tpserve.kernels.moe import tile_row_bounds


def test_sizes_cover_both_parities_and_every_expert_tile_bucket():
    assert prefill_warm_up_sizes(8192, None) == [8191, 8192]
    # Qwen3-30B-A3B's top 8 over buckets up to 512 and 4,096 rows: each bound's tokens, an even and an odd count
    assert prefill_warm_up_sizes(8192, 8, (512, 4096)) == [63, 64, 511, 512, 8191, 8192]
    assert prefill_warm_up_sizes(100, 8, (512, 4096)) == [63, 64, 99, 100]  # never past what the KV pool holds
    assert prefill_warm_up_sizes(2, None) == [2]


def test_warm_up_runs_those_prompts_and_changes_no_answer(tiny_model_factory, monkeypatch):
    model = tiny_model_factory("qwen3_moe")
    config = EngineConfig(model=model, device="cpu", dtype="float32", max_total_tokens=600, chunked_prefill_size=512)
    engine = Engine(config)
    prompts = prompts_for(3, engine.model_config.vocab_size, seed=5)
    before, before_logits = run_scenario(engine, prompts)
    lengths = []
    forward = engine.forward
    monkeypatch.setattr(engine, "forward", lambda seqs: lengths.append(len(seqs[0].token_ids)) or forward(seqs))
    sizes = engine._warm_up_prefill()
    top_k = engine.model_config.moe.top_k
    assert lengths == sizes == prefill_warm_up_sizes(512, top_k, tile_row_bounds())
    after, after_logits = run_scenario(engine, prompts)
    assert after == before
    for a, b in zip(after_logits, before_logits):  # NaN marks a row that did not run (run_scenario)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
