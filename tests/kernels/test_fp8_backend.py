"""Which FP8 GEMM a layer runs (``TPSERVE_FP8_GEMM``), and the weight blocks each one takes."""

from __future__ import annotations

import pytest
import torch

from tpserve.kernels.fp8_linear import (
    BACKENDS,
    CUDA_GEMV_TOKENS,
    FP8_GEMM_ENV,
    backend_from_env,
    check_weight_block,
    kernel_for,
    resolve_backend,
    warm_up_sizes,
)


def test_backend_choice_and_blocks(monkeypatch):
    check_weight_block("flashinfer", (128, 128), 384)
    check_weight_block("triton", (16, 32), 80)
    check_weight_block("cuda_triton", (128, 128), 208)
    with pytest.raises(ValueError, match="128x128"):
        check_weight_block("flashinfer", (32, 32), 64)
    with pytest.raises(ValueError, match="multiples of 128"):
        check_weight_block("cuda", (128, 128), 208)
    with pytest.raises(ValueError, match="multiples of 16"):
        check_weight_block("cuda_triton", (128, 128), 200)
    with pytest.raises(ValueError, match="128x128"):
        check_weight_block("cuda_triton", (64, 64), 256)
    # a scale a row (compressed-tensors, held as [rows, 1]: one (1, K) block a row): the GEMV at one token, Triton's
    # GEMM above
    check_weight_block("cuda_triton", (1, 208), 208, row_scales=True)
    for backend in ("cuda", "flashinfer"):
        with pytest.raises(ValueError, match="128x128"):
            check_weight_block(backend, (1, 256), 256, row_scales=True)
    with pytest.raises(ValueError, match="multiples of 16"):
        check_weight_block("cuda_triton", (1, 200), 200, row_scales=True)
    assert kernel_for("triton", 1) == "w8a8" and kernel_for("flashinfer", 1) == "flashinfer"
    assert [kernel_for("cuda", m) for m in (1, CUDA_GEMV_TOKENS, CUDA_GEMV_TOKENS + 1)] == ["cuda", "cuda", "flashinfer"]
    assert [kernel_for("cuda_triton", m) for m in (CUDA_GEMV_TOKENS, CUDA_GEMV_TOKENS + 1, 300)] == ["cuda", "w8a8", "w8a8"]
    monkeypatch.delenv(FP8_GEMM_ENV, raising=False)
    assert backend_from_env() == "auto"
    for name in ("gemv", "scaled_mm"):
        monkeypatch.setenv(FP8_GEMM_ENV, name)
        with pytest.raises(ValueError, match=f"{FP8_GEMM_ENV}.*cuda_triton"):
            backend_from_env()


def test_auto_on_the_cpu_is_the_triton_gemm():
    """The CPU (Triton's interpreter in the tests) takes the W8A8 GEMM; named backends stay."""
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, torch.bfloat16, (128, 128), 4096) == "triton"
    assert resolve_backend("auto", cpu, torch.float32, (16, 32), 80) == "triton"
    assert resolve_backend("auto", cpu, torch.bfloat16, (1, 4096), 4096, row_scales=True) == "triton"
    assert [resolve_backend(b, cpu, torch.bfloat16, (128, 128), 4096) for b in BACKENDS[1:]] == list(BACKENDS[1:])


def test_auto_gives_row_scaled_layers_the_gemv_at_one_token(monkeypatch):
    """A scale a row (compressed-tensors): ``auto`` takes the CUDA GEMV (its row-scaled kernel probed) at one token and
    Triton's GEMM above, where the GEMV reads K (% 16) and the activations are bf16; else Triton's GEMM throughout."""
    from tpserve.kernels import gemv

    cuda, block = torch.device("cuda", 0), (1, 4096)
    monkeypatch.setattr(gemv, "probe_rows", lambda index: None)
    assert resolve_backend("auto", cuda, torch.bfloat16, block, 4096, row_scales=True) == "cuda_triton"
    assert resolve_backend("auto", cuda, torch.bfloat16, block, 4104, row_scales=True) == "triton"
    assert resolve_backend("auto", cuda, torch.float16, block, 4096, row_scales=True) == "triton"
    monkeypatch.setattr(gemv, "probe_rows", lambda index: "no module")
    assert resolve_backend("auto", cuda, torch.bfloat16, block, 4096, row_scales=True) == "triton"
    # the GEMV's row-scaled kernel takes every batch the GEMV backends give it
    assert CUDA_GEMV_TOKENS <= gemv.ROW_SCALES_MAX_TOKENS


def test_warm_up_sizes_reach_every_tile_count():
    """FlashInfer's FP8 GEMM picks its tile from the swap-AB cut, the 64-row tile and the count of
    128-row tiles: the warm-up sizes hit each of those up to the prefill budget."""
    sizes = warm_up_sizes(8192)
    assert sizes[:3] == [2, 32, 64] and sizes[-1] == 8192 and sizes == sorted(set(sizes))
    assert {-(-m // 128) for m in sizes if m > 64} == set(range(1, 65))
    assert warm_up_sizes(300)[-1] == 384  # the last partial tile too


def test_warm_up_runs_each_shape_once_per_size(monkeypatch):
    """The startup warm-up runs FlashInfer's GEMM once per distinct weight shape and size, only for
    layers that take it (the GEMV-only and Triton backends compile nothing at run time)."""
    from tpserve.kernels import fp8_linear

    runs = []
    monkeypatch.setattr(fp8_linear, "fp8_linear", lambda x, weight, scale, block, backend: runs.append((tuple(weight.shape), x.shape[0])))

    class Layer(torch.nn.Module):
        def __init__(self, n: int, k: int, backend: str) -> None:
            super().__init__()
            self.weight, self.weight_scale_inv = torch.zeros(n, k), torch.ones(1, 1)
            self.block_size, self.fp8_backend = (128, 128), backend

    layers = [Layer(256, 128, "cuda"), Layer(256, 128, "cuda"), Layer(128, 256, "flashinfer"), Layer(64, 64, "cuda_triton")]
    sizes = [m for m in warm_up_sizes(512) if m > CUDA_GEMV_TOKENS]
    assert fp8_linear.warm_up(layers, 512) == 2 * len(sizes)
    assert sorted(runs) == sorted((shape, m) for shape in ((256, 128), (128, 256)) for m in sizes)


def test_row_scaled_weights_stay_fp8_at_any_input_width(monkeypatch):
    """A row-scaled layer's block is (1, K): a K not divisible by 16 (a row-parallel cut) still takes the row-wise GEMM,
    which masks its K tiles; block scales need their blocks % 16 (a K tile in one block)."""
    from tpserve import kernels

    cpu = torch.device("cpu")
    monkeypatch.setattr(kernels, "use_fp8_triton", lambda device: True)
    assert kernels.use_fp8_gemm(cpu, (1, 200), row_scales=True)
    assert not kernels.use_fp8_gemm(cpu, (128, 200)) and kernels.use_fp8_gemm(cpu, (128, 128))
    monkeypatch.setattr(kernels, "use_fp8_triton", lambda device: False)
    assert not kernels.use_fp8_gemm(cpu, (1, 208), row_scales=True)
