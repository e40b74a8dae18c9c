"""The backend interface's shared part: ``forward`` stores the step's k/v and then calls the
backend's ``attend``. FlashInfer's ``attend`` is driven here
with a stand-in wrapper, since FlashInfer itself only runs on the GPU (tests/gpu)."""

from __future__ import annotations

import torch

from tpserve.attention.base import AttentionBackend
from tpserve.attention.flashinfer_backend import FlashInferAttentionBackend, FlashInferMetadata
from tpserve.kvcache.pool import KVCachePool


class RecordingWrapper:
    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = []

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.calls.append((q, kv))
        return q * 2


def flashinfer_backend_on_cpu(pool: KVCachePool) -> FlashInferAttentionBackend:
    backend = object.__new__(FlashInferAttentionBackend)  # skip the CUDA-only set-up
    AttentionBackend.__init__(backend, pool, 2, 1, 4)
    return backend


def test_forward_stores_kv_then_attends_on_the_cache():
    pool = KVCachePool(2, 4, 2, 1, 4, torch.float32, torch.device("cpu"))
    backend = flashinfer_backend_on_cpu(pool)
    qkv = torch.randn(3, 16)
    q = qkv[:, :8].view(3, 2, 4)  # a strided view, as in the model
    k, v = qkv[:, 8:12].view(3, 1, 4), qkv[:, 12:].view(3, 1, 4)
    slots = torch.tensor([2, 3, 7])
    wrapper = RecordingWrapper()
    out = backend.forward(1, q, k, v, slots, FlashInferMetadata(wrapper))
    (q_run, (k_cache, v_cache)), = wrapper.calls
    assert q_run.is_contiguous() and torch.equal(q_run, q) and torch.equal(out, 2 * q)
    assert k_cache is pool.k[1] and v_cache is pool.v[1]
    assert torch.equal(pool.k[1].view(-1, 1, 4)[slots], k) and torch.equal(pool.v[1].view(-1, 1, 4)[slots], v)
    assert not pool.k[0].any(), "only the layer's own cache is written"


def test_decode_kernel_choice():
    from tpserve.attention.flashinfer_backend import decode_kernel_choice

    def no_call() -> bool:
        raise AssertionError("auto_triton is asked only under auto over bf16/fp16 pages")

    for kernel in ("flashinfer", "xqa", "triton"):  # asked for: taken, whatever the pages
        for fp8 in (False, True):
            assert decode_kernel_choice(kernel, fp8, no_call) == kernel
    assert decode_kernel_choice("auto", True, no_call) == "xqa"
    assert decode_kernel_choice("auto", False, lambda: True) == "triton"
    assert decode_kernel_choice("auto", False, lambda: False) == "flashinfer"


def test_decode_kernel_and_its_batch_limit(monkeypatch):
    """What the backend builds from the choice: ``auto``'s Triton kernel stops at AUTO_MAX_BATCH; an
    explicit ``xqa`` over bf16 pages goes to XQA's checks, not to ``auto``'s Triton kernel."""
    import sys

    import pytest

    from tpserve.attention import xqa
    from tpserve.attention.flashinfer_backend import FlashInferAttentionBackend
    from tpserve.attention.triton_decode import AUTO_MAX_BATCH, TritonDecode

    monkeypatch.setattr(xqa, "unsupported_reason", lambda *args: "no XQA on this machine")
    for fp8 in (False, True):
        dtype = torch.float8_e4m3fn if fp8 else torch.float32
        pool = KVCachePool(1, 4, 16, 2, 16, dtype, torch.device("cpu"), torch.float32)
        backend = object.__new__(FlashInferAttentionBackend)  # skip the CUDA-only set-up
        AttentionBackend.__init__(backend, pool, 4, 2, 16)
        backend.device, backend.flashinfer = torch.device("cpu"), None
        backend._auto_triton = lambda: True
        assert backend._make_table_decode("flashinfer") == (None, 0)
        with pytest.raises(ValueError, match="decode attention xqa: no XQA on this machine"):
            backend._make_table_decode("xqa")
        if fp8:
            assert backend._make_table_decode("auto") == (None, 0)  # XQA cannot: the decode wrapper
            continue
        kernel, limit = backend._make_table_decode("auto")
        assert isinstance(kernel, TritonDecode) and limit == AUTO_MAX_BATCH
        assert backend._make_table_decode("triton")[1] == sys.maxsize
        backend._auto_triton = lambda: False
        assert backend._make_table_decode("auto") == (None, 0)


def test_drafted_steps_as_decode_rows_reach_the_table_kernels(monkeypatch):
    """With speculative decoding (rows_per_sequence 1 + drafts) Triton's kernel re-reads that many newest keys after
    its PDL wait, and XQA, whose sm90 build reads every 64-key tile but the newest before its wait, runs without PDL."""
    from tpserve.attention import xqa
    from tpserve.attention.flashinfer_backend import FlashInferAttentionBackend

    built = []
    monkeypatch.setattr(xqa, "unsupported_reason", lambda *args: None)
    monkeypatch.setattr(xqa, "XqaDecode", lambda *args, pdl: built.append(pdl) or "xqa")
    for rows in (1, 5):
        for fp8 in (False, True):
            dtype = torch.float8_e4m3fn if fp8 else torch.float32
            pool = KVCachePool(1, 4, 16, 2, 16, dtype, torch.device("cpu"), torch.float32)
            backend = object.__new__(FlashInferAttentionBackend)  # skip the CUDA-only set-up
            AttentionBackend.__init__(backend, pool, 4, 2, 16)
            backend.device, backend.flashinfer, backend.rows_per_sequence = torch.device("cpu"), None, rows
            backend._auto_triton = lambda: True
            kernel, _ = backend._make_table_decode("auto")
            if fp8:
                assert kernel == "xqa" and built[-1] is (rows == 1)
            else:
                assert kernel.fresh_tokens == rows


class PlanRecorder:
    """A FlashInfer wrapper that records its plans' keyword arguments."""

    def __init__(self) -> None:
        self.plans: list[dict] = []

    def plan(self, *args, **kwargs) -> None:
        self.plans.append(kwargs)


def test_every_flashinfer_plan_takes_the_soft_cap_and_the_scale(monkeypatch):
    """Gemma 2's attention soft-cap reaches every FlashInfer plan (prefill, decode, a CUDA graph's decode; each window's
    wrapper) beside the softmax scale: FlashInfer computes cap * tanh(sm_scale * q.k / cap), transformers' order
    (FlashInfer 0.7.0's LogitsSoftCap variant: the scale times 1 / cap before the tanh, cap * log2(e) after)."""
    from tpserve.attention.flashinfer_backend import FlashInferAttentionBackend
    from tpserve.forward import SequenceInput

    pool = KVCachePool(2, 8, 4, 2, 16, torch.float32, torch.device("cpu"))
    backend = object.__new__(FlashInferAttentionBackend)  # skip the CUDA-only set-up
    AttentionBackend.__init__(backend, pool, 4, 2, 16, scale=0.125, layer_windows=(8, 0), softcap=50.0)
    backend.dtype, backend.table_decode, backend.table_decode_max_batch = torch.float32, None, 0
    backend.prefill_wrappers = {w: PlanRecorder() for w in backend.windows}
    backend.decode_wrappers = {w: PlanRecorder() for w in backend.windows}
    monkeypatch.setattr(backend, "_stage", lambda layout: layout)  # (pinned host memory needs CUDA)
    monkeypatch.setattr(backend, "_mark_planned", lambda: None)
    backend.prepare([SequenceInput([1, 2, 3], 2, [1, 2])], torch.device("cpu"))
    backend.prepare([SequenceInput([1], 5, [1, 2])], torch.device("cpu"))
    graph = FlashInferMetadata(PlanRecorder(), {8: PlanRecorder()})
    backend._graph_indices = torch.zeros(16, dtype=torch.int32)
    backend.plan_cuda_graph([SequenceInput([1], 5, [1, 2])], graph, 2)
    wrappers = [*backend.prefill_wrappers.values(), *backend.decode_wrappers.values(), graph.wrapper, graph.windowed[8]]
    plans = [plan for wrapper in wrappers for plan in wrapper.plans]
    assert len(plans) == 6
    assert all(plan["logits_soft_cap"] == 50.0 and plan["sm_scale"] == 0.125 for plan in plans), plans


def test_a_soft_capped_model_decodes_without_xqa(monkeypatch):
    """XQA has no soft-cap in tpserve: asked for, it is refused by name; under ``auto`` over FP8 pages the decode
    wrapper runs; the Triton kernel takes the backend's cap."""
    import pytest

    from tpserve.attention import xqa
    from tpserve.attention.flashinfer_backend import FlashInferAttentionBackend

    monkeypatch.setattr(xqa, "unsupported_reason", lambda *args: None)  # XQA could run but for the cap
    monkeypatch.setattr(xqa, "XqaDecode", lambda *args: pytest.fail("XQA built for a soft-capped model"))
    for fp8 in (False, True):
        dtype = torch.float8_e4m3fn if fp8 else torch.float32
        pool = KVCachePool(1, 4, 16, 2, 16, dtype, torch.device("cpu"), torch.float32)
        backend = object.__new__(FlashInferAttentionBackend)  # skip the CUDA-only set-up
        AttentionBackend.__init__(backend, pool, 4, 2, 16, softcap=30.0)
        backend.device, backend.flashinfer = torch.device("cpu"), None
        backend._auto_triton = lambda: True
        with pytest.raises(ValueError, match="decode attention xqa: tpserve does not run XQA with attention logit "
                                             "soft-capping"):
            backend._make_table_decode("xqa")
        if fp8:
            assert backend._make_table_decode("auto") == (None, 0)
        else:
            assert backend._make_table_decode("triton")[0].softcap == 30.0


def test_each_window_in_use_plans_a_wrapper_of_its_own(monkeypatch):
    """FlashInfer's window_left is the window - 1 (the query's own token excluded; -1: none) in each window's wrapper,
    prefill, decode and a CUDA graph's; a model whose layers all have a window plans no full-context wrapper."""
    from tpserve.attention.flashinfer_backend import FlashInferAttentionBackend
    from tpserve.forward import SequenceInput

    for layer_windows, expected in (((8, 0), {0: -1, 8: 7}), ((8, 8), {8: 7}), ((), {0: -1})):
        pool = KVCachePool(2, 8, 4, 2, 16, torch.float32, torch.device("cpu"))
        backend = object.__new__(FlashInferAttentionBackend)  # skip the CUDA-only set-up
        AttentionBackend.__init__(backend, pool, 4, 2, 16, layer_windows=layer_windows)
        assert backend.windows == sorted(expected)
        backend.dtype, backend.table_decode, backend.table_decode_max_batch = torch.float32, None, 0
        backend.prefill_wrappers = {w: PlanRecorder() for w in backend.windows}
        backend.decode_wrappers = {w: PlanRecorder() for w in backend.windows}
        monkeypatch.setattr(backend, "_stage", lambda layout: layout)  # (pinned host memory needs CUDA)
        monkeypatch.setattr(backend, "_mark_planned", lambda: None)
        for seq in (SequenceInput([1, 2, 3], 2, [1, 2]), SequenceInput([1], 5, [1, 2])):
            meta = backend.prepare([seq], torch.device("cpu"))
            assert (meta.wrapper is None) == (0 not in expected) and sorted(meta.windowed) == [w for w in expected if w]
        graph = FlashInferMetadata(PlanRecorder() if 0 in expected else None,
                                   {w: PlanRecorder() for w in expected if w})
        backend._graph_indices = torch.zeros(16, dtype=torch.int32)
        backend.plan_cuda_graph([SequenceInput([1], 5, [1, 2])], graph, 2)
        for window, left in expected.items():
            wrappers = (backend.prefill_wrappers[window], backend.decode_wrappers[window],
                        graph.windowed[window] if window else graph.wrapper)
            assert [plan["window_left"] for wrapper in wrappers for plan in wrapper.plans] == [left] * 3, layer_windows
