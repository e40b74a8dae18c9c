"""Sliding-window attention on a GPU (the CPU path against transformers: tests/models/test_sliding_window.py and
test_vs_transformers). Each kernel against float32 torch attention within the window, on layer 1 of a cache whose
layer 0 has no window: FlashInfer's prefill wrapper (a prefill and a chunk on a cached prefix), its decode wrapper
eager and as a CUDA graph's (planned per window beside the full one), and the Triton decode kernel (eager and in a
graph). Then whole bf16 engines with FlashInfer and CUDA graphs against the torch backend's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
)
pytest.importorskip("flashinfer")

from paged_reference import (HEAD_DIM, HEADS, KV_HEADS, PAGE, RTOL, WINDOW, capture_both_layers, random_pool,
                             reference)
from reference import rel_err
from tpserve.attention.flashinfer_backend import FlashInferAttentionBackend
from tpserve.attention.page_table import TableMetadata
from tpserve.forward import SequenceInput
from tpserve.kvcache.pool import PageAllocator


def windowed_backend(kernel: str) -> FlashInferAttentionBackend:
    """Over a random two-layer cache: layer 0 without a window, layer 1 within WINDOW; decode by ``kernel``."""
    return FlashInferAttentionBackend(random_pool(), HEADS, KV_HEADS, HEAD_DIM, torch.device("cuda"),
                                      decode_kernel=kernel, layer_windows=(0, WINDOW))


def check(backend, meta, seqs: list[SequenceInput], q: torch.Tensor, label: str) -> None:
    """Layer 1 (windowed) against the windowed reference, and unlike the unwindowed one where a sequence passes the
    window; layer 0 against the whole context."""
    starts = [0]
    for seq in seqs:
        starts.append(starts[-1] + len(seq.token_ids))
    for layer, window in ((1, WINDOW), (0, 0)):
        out = backend.attend(layer, q, meta)[: starts[-1]]
        expected = torch.cat([reference(backend.pool, layer, q[a:b], s, window)
                              for s, a, b in zip(seqs, starts, starts[1:])])
        err = rel_err(out, expected)
        print(f"{label} layer {layer}: relative error {err:.2e}")
        assert err < RTOL, (label, layer, err)
    unwindowed = torch.cat([reference(backend.pool, 1, q[a:b], s, 0) for s, a, b in zip(seqs, starts, starts[1:])])
    assert rel_err(backend.attend(1, q, meta)[: starts[-1]], unwindowed) > 10 * RTOL, label


@pytest.mark.parametrize("kernel", ["flashinfer", "triton"])
def test_prefill_and_decode_within_the_window(kernel):
    backend = windowed_backend(kernel)
    allocator = PageAllocator(backend.pool.num_pages)
    # a prefill longer than the window, a chunk of 37 on a prefix of 200, a short prefill
    prefill = [SequenceInput([1] * n, p, allocator.allocate(-(-(p + n) // PAGE))) for p, n in ((0, 150), (200, 37),
                                                                                              (0, 20))]
    q = torch.randn(207, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    check(backend, backend.prepare(prefill, q.device), prefill, q, f"{kernel} prefill")
    lengths = [1, 60, 100, 101, 300, 2049]
    decode = [SequenceInput([1], n - 1, allocator.allocate(-(-n // PAGE))) for n in lengths]
    q = torch.randn(len(decode), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    meta = backend.prepare(decode, q.device)
    assert isinstance(meta, TableMetadata) == (kernel == "triton")
    check(backend, meta, decode, q, f"{kernel} decode")


@pytest.mark.parametrize("kernel", ["flashinfer", "triton"])
def test_decode_graph_within_the_window(kernel):
    """A graph captured on padding, replayed for batches on both sides of the window."""
    backend = windowed_backend(kernel)
    pool, allocator = backend.pool, PageAllocator(backend.pool.num_pages)
    size = 8
    graph, meta, q, outs = capture_both_layers(backend, size)
    for lengths in ([4000, 17, 1], [16, 2049, 300, 15, 1, 101, 33, 100]):
        seqs = [SequenceInput([1], n - 1, allocator.allocate(-(-n // PAGE))) for n in lengths]
        q.copy_(torch.randn(size, HEADS, HEAD_DIM, device="cuda"))
        backend.plan_cuda_graph(seqs, meta, size)
        graph.replay()
        for layer, window in ((0, 0), (1, WINDOW)):
            expected = torch.cat([reference(pool, layer, q[i : i + 1], s, window) for i, s in enumerate(seqs)])
            err = rel_err(outs[layer][: len(seqs)], expected)
            print(f"{kernel} graph {lengths} layer {layer}: relative error {err:.2e}")
            assert err < RTOL
        for seq in seqs:
            allocator.free(seq.page_table)


@pytest.mark.parametrize("decode", ["auto", "flashinfer"])
def test_engine_with_flashinfer_and_graphs_matches_torch_attention(tiny_model_factory, tmp_path, decode):
    """A tiny Qwen3 (head_dim 128) whose layers 1-3 attend within 16 tokens, in bf16: FlashInfer with CUDA graphs
    (decode: Triton's kernel under auto, the decode wrapper) against the torch backend, teacher-forced, as near as
    the same comparison without a window is; the windowless torch backend is far from both."""
    from engine_scenario import teacher_forced_errors
    from tpserve.engine.engine import Engine
    from tpserve.engine_config import EngineConfig

    shape = {"head_dim": 128, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512,
             "num_layers": 4}
    windowed = tiny_model_factory("qwen3", sliding_window=16, **shape)
    plain = tmp_path / "plain"
    shutil.copytree(windowed, plain)
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "use_sliding_window": False, "sliding_window": None,
                                                   "layer_types": ["full_attention"] * 4}))

    def make_engine(model_dir: str, backend: str) -> Engine:
        return Engine(EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", attention_backend=backend,
                                   cuda_graph_max_bs=16 if backend == "flashinfer" else 0, decode_attention=decode
                                   if backend == "flashinfer" else "auto", max_total_tokens=16384, page_size=16))

    def errors(engine_dir, reference_dir) -> list[float]:
        return teacher_forced_errors(make_engine, engine_dir, reference_dir)[0]

    window, baseline, unwindowed = errors(windowed, windowed), errors(plain, plain), errors(windowed, plain)
    print(f"{decode}: max relative logits error by step {max(window):.2e} (no window: {max(baseline):.2e}; "
          f"against the windowless reference {max(unwindowed):.2e})")
    assert max(window) < 2 * max(baseline), (window, baseline)
    assert max(unwindowed) > 5 * max(baseline), (unwindowed, baseline)
