"""On the GPU: constrained decoding (grammar masks), penalties and logit bias stay correct with
overlap scheduling and CUDA graphs on. The mask of step i+1 needs step i's token: with overlap the
engine enqueues step i+1's forward first and samples it once the host has applied step i's
tokens to the matchers, so every combination must give valid JSON and the same greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 4},
    },
    "required": ["name", "ok", "n", "tags"],
    "additionalProperties": False,
}


def test_constrained_path_with_overlap_and_graphs(tmp_path):
    pytest.importorskip("flashinfer")
    jsonschema = pytest.importorskip("jsonschema")
    from tpserve import LLM, SamplingParams
    from tpserve.sampling_params import StructuredOutput
    from tpserve.tiny import make_tiny_model

    model = make_tiny_model(str(tmp_path / "m"), "qwen3", hidden_size=256, num_heads=2, num_kv_heads=1, head_dim=128)
    schema = StructuredOutput("json_schema", json.dumps(SCHEMA))
    prompts = [[3 + i, 4 + i, 5 + i] * (1 + i % 4) for i in range(24)]
    params = []
    for i in range(24):
        if i % 3 == 0:  # constrained, greedy and sampled
            params.append(SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=120, structured=schema))
        elif i % 3 == 1:  # penalties and bias on the device-side token history
            params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                                         frequency_penalty=0.5, logit_bias={7: 5.0}))
        else:  # unconstrained neighbours
            params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    results = {}
    for overlap in (False, True):
        for graph_bs in (0, 32):
            llm = LLM(model, device="cuda", dtype="bfloat16", disable_overlap=not overlap, cuda_graph_max_bs=graph_bs)
            outs = llm.generate(prompts, params, use_tqdm=False)
            llm.close()
            for i, out in enumerate(outs):
                if i % 3 == 0:
                    assert out.finish_reason == "stop", (overlap, graph_bs, out.text)
                    jsonschema.validate(json.loads(out.text), SCHEMA)
            results[(overlap, graph_bs)] = [o.token_ids for o in outs]
    base = results[(False, 0)]
    for key, tokens in results.items():
        same = sum(a == b for a, b in zip(tokens, base))
        assert same >= 22, f"{key}: only {same}/24 requests identical to overlap off, graphs off"


def test_gpu_mask_kernel_equals_the_cpu_one():
    """xgrammar's Triton kernel (GPU) and C++ one (CPU) mask the same tokens, on the layouts the
    engine hands them: bf16 rows padded as at TP > 1 (in place on the LM head's output) and
    contiguous float32 (after penalties)."""
    pytest.importorskip("triton")
    from tpserve.structured.mask import apply_bitmask

    gen = torch.Generator().manual_seed(0)
    rows, vocab = 24, 151936
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    constrained = [0, 3, 4, 17, 23]
    for dtype, pad in ((torch.bfloat16, 64), (torch.float32, 0)):
        padded = torch.randn(rows, vocab + pad, generator=gen).to(dtype)
        cpu = padded[:, :vocab].clone()
        apply_bitmask(cpu, bitmask, constrained)
        gpu = padded.cuda()
        apply_bitmask(gpu[:, :vocab], bitmask.cuda(), torch.tensor(constrained, dtype=torch.int32, device="cuda"))
        assert torch.equal(gpu[:, :vocab].cpu(), cpu), dtype
        assert torch.equal(gpu[:, vocab:].cpu(), padded[:, vocab:]), "the padding is untouched"


def test_sampling_kernel_reads_the_mask_as_masking_first_does():
    """The unfiltered sampling kernel applying the bitmask as it reads the logits picks the
    tokens it picks from logits masked first (xgrammar's kernel), greedy and sampled rows, on the
    LM head's padded bf16 layout and on float32, at the real vocabulary size."""
    pytest.importorskip("triton")
    from tpserve.engine.sampler import SamplingBatch
    from tpserve.kernels.sampling import sample
    from tpserve.sampling_params import SamplingParams
    from tpserve.structured.mask import apply_bitmask, unpack_bitmask

    gen = torch.Generator().manual_seed(1)
    rows, vocab = 64, 151936
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, -(-vocab // 32)), dtype=torch.int32, generator=gen)
    bitmask[::4] = -1  # unconstrained rows
    bitmask[1, :] = 0
    bitmask[1, 100] = 1 << 5  # a row with one allowed token: 3205
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.7) for i in range(rows)]
    batch = SamplingBatch.build(params, list(range(rows)), [5] * rows, vocab, "cuda")
    device_mask = bitmask.cuda()
    for dtype, pad in ((torch.bfloat16, 64), (torch.float32, 0)):
        logits = (4 * torch.randn(rows, vocab + pad, generator=gen)).to(dtype).cuda()[:, :vocab]
        fused = sample(logits, batch.temperatures, batch.seeds, batch.steps, bitmask=device_mask)
        masked = logits.clone()
        apply_bitmask(masked, device_mask)
        assert torch.equal(fused, sample(masked, batch.temperatures, batch.seeds, batch.steps)), dtype
        assert bool(unpack_bitmask(device_mask, vocab).gather(1, fused[:, None]).all())
        assert int(fused[1]) == 3205
