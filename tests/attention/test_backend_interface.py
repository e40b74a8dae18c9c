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
