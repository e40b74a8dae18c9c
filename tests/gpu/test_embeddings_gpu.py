"""Embedding requests on the GPU path (bf16, FlashInfer/Triton attention, the CUDA GEMV with the final norm fused at
one token, CUDA graphs for the decodes beside them) against transformers' base model in float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("flashinfer")

from reference import hf_embedding
from tpserve.engine.engine import Engine
from tpserve.engine_config import EngineConfig
from tpserve.sampling_params import SamplingParams
from tpserve.scheduler.scheduler import Scheduler


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("qwen3", num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=128,
                              intermediate_size=512, seed=3)


@pytest.mark.parametrize("chunk", [8192, 16])
def test_embeddings_on_the_gpu_match_transformers(model_dir, chunk):
    engine = Engine(EngineConfig(model=model_dir, device="cuda", dtype="bfloat16", chunked_prefill_size=chunk,
                                 max_total_tokens=8192))
    scheduler = Scheduler(engine)
    prompts = {1: list(range(3, 60)), 2: [7], 3: [5, 6, 7, 8, 9]}
    scheduler.add_request(9, [9, 10, 11], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), seed=9)
    scheduler.step()  # the decodes run in CUDA graphs beside the embeddings
    for rid, prompt in prompts.items():
        scheduler.add_request(rid, prompt, SamplingParams(pooling="embed"), seed=rid)
    answers = {}
    while scheduler.has_work:
        for out in scheduler.step():
            if out.embedding is not None:
                answers[out.rid] = np.frombuffer(out.embedding, dtype="<f4")
    from transformers import AutoModel

    bf16 = AutoModel.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    worst, oracle = 0.0, 0.0  # 1 - cosine against float32: tpserve's, and transformers' own in bf16
    for rid, prompt in prompts.items():
        expected = hf_embedding(model_dir, prompt)
        got = torch.nn.functional.normalize(torch.from_numpy(answers[rid].copy()), dim=0)
        worst = max(worst, 1 - float(got @ expected))
        with torch.inference_mode():
            theirs = bf16(torch.tensor([prompt], device="cuda")).last_hidden_state[0, -1].float().cpu()
        oracle = max(oracle, 1 - float(torch.nn.functional.normalize(theirs, dim=0) @ expected))
    print(f"chunk {chunk}: worst 1 - cosine vs transformers float32: {worst:.2e} (transformers in bf16: {oracle:.2e})")
    assert worst <= 2 * oracle + 1e-4  # bf16's error, as transformers makes it in bf16
