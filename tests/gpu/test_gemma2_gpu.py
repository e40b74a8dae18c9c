"""Gemma 2 on a GPU (CPU correctness against transformers: tests/models/test_gemma2.py and test_vs_transformers). Each
soft-capped attention kernel against float32 torch attention with the cap, on layer 1 of a cache (a sliding window) and
layer 0 (none), as Gemma 2's layers alternate: FlashInfer's prefill wrapper, its decode wrapper and the Triton decode
kernel, eager and replayed in a CUDA graph; each far from the uncapped answer. Then whole engines: float32 tokens equal
transformers' (its GELU MLP never on a SiLU path), and bf16 FlashInfer with CUDA graphs (decode: Triton's kernel under
auto, FlashInfer's wrapper) as near the torch backend's logits as a Qwen3 of the same shape's are, and far from a
model without the attention cap."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from reference import hf_greedy, rel_err
from paged_reference import (HEAD_DIM, HEADS, KV_HEADS, PAGE, RTOL, WINDOW, capture_both_layers, random_pool,
                             reference)
from tpserve import LLM, SamplingParams
from tpserve.forward import SequenceInput
from tpserve.tiny.config import GEMMA2_SOFTCAPS
from tpserve.kvcache.pool import KVCachePool, PageAllocator

hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41], list(range(100, 137))]
# head_dim 128 (FlashInfer's), hidden_size != heads x head_dim as Gemma 2 2B's; untied (the tiny tied Gemma 2 repeats
# one token)
SHAPE = {"head_dim": 128, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512,
         "num_layers": 4}
CAP, Q_GAIN = 4.0, 2.0  # q ~ N(0, 4): scaled scores with a spread of ~2, which a cap of 4 bends


def capped_backend(pool: KVCachePool, kernel: str):
    from tpserve.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(pool, HEADS, KV_HEADS, HEAD_DIM, torch.device("cuda"), decode_kernel=kernel,
                                      layer_windows=(0, WINDOW), softcap=CAP)


def check(out_of, pool: KVCachePool, seqs: list[SequenceInput], q: torch.Tensor, label: str) -> None:
    """``out_of(layer)`` against the capped reference (layer 1 within the window, layer 0 not), and far from the
    uncapped one."""
    starts = [0]
    for seq in seqs:
        starts.append(starts[-1] + len(seq.token_ids))

    def expected(layer: int, window: int, softcap: float | None) -> torch.Tensor:
        return torch.cat([reference(pool, layer, q[a:b], s, window, softcap)
                          for s, a, b in zip(seqs, starts, starts[1:])])

    for layer, window in ((1, WINDOW), (0, 0)):
        err = rel_err(out_of(layer)[: starts[-1]], expected(layer, window, CAP))
        print(f"{label} layer {layer}: relative error {err:.2e}")
        assert err < RTOL, (label, layer, err)
    assert rel_err(out_of(0)[: starts[-1]], expected(0, 0, None)) > 10 * RTOL, label


@hopper
@pytest.mark.parametrize("kernel", ["flashinfer", "triton"])
def test_capped_prefill_and_decode(kernel):
    pytest.importorskip("flashinfer")
    from tpserve.attention.page_table import TableMetadata

    pool = random_pool()
    backend = capped_backend(pool, kernel)
    allocator = PageAllocator(pool.num_pages)
    # a prefill longer than the window, a chunk of 37 on a prefix of 200, a short prefill
    prefill = [SequenceInput([1] * n, p, allocator.allocate(-(-(p + n) // PAGE))) for p, n in ((0, 150), (200, 37),
                                                                                              (0, 20))]
    q = Q_GAIN * torch.randn(207, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    meta = backend.prepare(prefill, q.device)
    check(lambda layer: backend.attend(layer, q, meta), pool, prefill, q, f"{kernel} prefill")
    lengths = [1, 60, 100, 101, 300, 2049]
    decode = [SequenceInput([1], n - 1, allocator.allocate(-(-n // PAGE))) for n in lengths]
    q = Q_GAIN * torch.randn(len(decode), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    meta = backend.prepare(decode, q.device)
    assert isinstance(meta, TableMetadata) == (kernel == "triton")
    check(lambda layer: backend.attend(layer, q, meta), pool, decode, q, f"{kernel} decode")


@hopper
@pytest.mark.parametrize("kernel", ["flashinfer", "triton"])
def test_capped_decode_graph(kernel):
    """A graph captured on padding, replayed for batches on both sides of the window."""
    pytest.importorskip("flashinfer")
    pool = random_pool()
    backend = capped_backend(pool, kernel)
    allocator = PageAllocator(pool.num_pages)
    size = 8
    graph, meta, q, outs = capture_both_layers(backend, size)
    for lengths in ([4000, 17, 1], [16, 2049, 300, 15, 1, 101, 33, 100]):
        seqs = [SequenceInput([1], n - 1, allocator.allocate(-(-n // PAGE))) for n in lengths]
        q.copy_(Q_GAIN * torch.randn(size, HEADS, HEAD_DIM, device="cuda"))
        backend.plan_cuda_graph(seqs, meta, size)
        graph.replay()
        check(lambda layer: outs[layer], pool, seqs, q, f"{kernel} graph {lengths}")
        for seq in seqs:
            allocator.free(seq.page_table)


def test_float32_on_cuda_matches_transformers(tiny_model_factory, no_silu):
    model_dir = tiny_model_factory("gemma2", **SHAPE)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(model_dir, device="cuda", dtype="float32") as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, 12) for p in PROMPTS]


@hopper
@pytest.mark.parametrize("decode", ["auto", "flashinfer"])
def test_bf16_flashinfer_and_graphs_match_torch_attention(tiny_model_factory, tmp_path, no_silu, decode):
    """The engines' logits step by step (teacher-forced), FlashInfer with graphs against the torch backend: as near as
    a Qwen3 of the same shape's are (the oracle is that baseline's worst step, times 2, as test_gemma3_gpu's), and
    far from the torch backend's without the attention cap."""
    pytest.importorskip("flashinfer")
    from engine_scenario import assert_same_greedy, teacher_forced_errors
    from tpserve.engine.engine import Engine
    from tpserve.engine_config import EngineConfig

    def make_engine(model_dir: str, backend: str) -> Engine:
        return Engine(EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", attention_backend=backend,
                                   cuda_graph_max_bs=16 if backend == "flashinfer" else 0,
                                   decode_attention=decode if backend == "flashinfer" else "auto",
                                   max_total_tokens=16384, page_size=16))

    capped = tiny_model_factory("gemma2", **SHAPE)
    uncapped = tmp_path / "uncapped"
    shutil.copytree(capped, uncapped)
    config = json.loads((uncapped / "config.json").read_text())
    (uncapped / "config.json").write_text(json.dumps({**config, "attn_logit_softcapping": None}))
    gemma, greedy = teacher_forced_errors(make_engine, capped, capped)
    without_cap, _ = teacher_forced_errors(make_engine, capped, str(uncapped))
    no_silu.undo()  # the Qwen3 baseline's MLP is SiLU's
    qwen_dir = tiny_model_factory("qwen3", **SHAPE)
    qwen, _ = teacher_forced_errors(make_engine, qwen_dir, qwen_dir)
    print(f"{decode}: relative logits error by step: Gemma 2 max {max(gemma):.2e}, Qwen3 of its shape max "
          f"{max(qwen):.2e}, against the torch backend without the attention cap {max(without_cap):.2e}")
    assert max(gemma) < 2 * max(qwen), (gemma, qwen)
    assert max(without_cap) > 5 * max(qwen), (without_cap, qwen)
    # The final soft-cap (5 on the tiny model) holds every logit in (-5, 5): bf16 rounding, ~5% of the logits' norm a
    # step as for the Qwen3 baseline, moves a margin by more than engine_scenario's NEAR_TIE there (both bf16 engine
    # tests failed at 0.05 on an H100, session 52), so a tie is a margin under 5% of the cap. At that, 4 and 5 of the
    # 6 sequences still part at a tie (session 54, H100): the squashed top logits sit within the rounding, so the
    # check is that each parts at a tie, the logits above being this test's oracle.
    assert_same_greedy(*greedy, near_tie=0.05 * GEMMA2_SOFTCAPS["final_logit_softcapping"], ties_expected=True)
