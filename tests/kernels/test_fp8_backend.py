"""Which FP8 GEMM a layer runs (``TPSERVE_FP8_GEMM``), and the weight blocks each one takes."""

from __future__ import annotations

import pytest

from tpserve.kernels.fp8_gemv import GemvConfig, check_config, default_config
from tpserve.kernels.fp8_linear import (
    FP8_GEMM_ENV,
    CUDA_GEMV_TOKENS,
    backend_from_env,
    check_weight_block,
    fuses_gate,
    kernel_for,
)

# Qwen3-8B's and Qwen3-32B's linears at TP 1: (N, K)
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (10240, 5120), (5120, 8192), (51200, 5120), (5120, 25600)]


def test_backend_choice_and_blocks(monkeypatch):
    check_weight_block("flashinfer", (128, 128), 384)
    check_weight_block("gemv", (16, 32), 80)
    with pytest.raises(ValueError, match="128x128"):
        check_weight_block("flashinfer", (32, 32), 64)
    with pytest.raises(ValueError, match="multiples of 128"):
        check_weight_block("cuda", (128, 128), 200)
    assert [kernel_for("gemv", m) for m in (1, 64, 65)] == ["gemv", "gemv", "w8a8"]
    assert kernel_for("triton", 1) == "w8a8"
    assert [kernel_for("cuda", m) for m in (1, CUDA_GEMV_TOKENS, CUDA_GEMV_TOKENS + 1)] == ["cuda", "cuda", "flashinfer"]
    assert not fuses_gate("cuda", 1)
    with pytest.raises(ValueError, match="128x128"):
        check_weight_block("cuda", (64, 64), 256)
    monkeypatch.delenv(FP8_GEMM_ENV, raising=False)
    assert backend_from_env() == "auto"
    monkeypatch.setenv(FP8_GEMM_ENV, "scaled_mm")
    with pytest.raises(ValueError, match=FP8_GEMM_ENV):
        backend_from_env()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 4])
def test_gemv_defaults_fill_an_h200(n, k, m):
    """Every Qwen3-8B/-32B linear at few tokens: >= 2 programs per SM (132 SMs), >= 32 KB of
    weights each, 8 KB tiles of 16-byte loads."""
    config = default_config(m, n, k, 128, 132)
    check_config(config, m, 128)
    programs = -(-n // config.block_n) * config.split_k
    assert config.variant == "fma" and config.block_m >= m and config.prefetch
    assert programs >= 2 * 132 and n * k / programs >= 32 * 1024
    assert config.block_n * config.block_k == 8192
    if m == 1:
        assert config.block_k == 128 and config.num_warps * 32 * 32 == 8192  # two 16-byte loads a thread


def test_gemv_config_checks():
    with pytest.raises(ValueError, match="power-of-two block_m"):
        check_config(GemvConfig(2, 8, 512, 1, 4, 1), 3, 128)
    with pytest.raises(ValueError, match="multiple of the power-of-two scale group"):
        check_config(GemvConfig(1, 8, 512, 1, 4, 1), 1, 96)
    with pytest.raises(ValueError, match="divide the scale group"):
        check_config(GemvConfig(1, 8, 64, 1, 4, 1), 1, 96)
    with pytest.raises(ValueError, match="dots take"):
        check_config(GemvConfig(16, 8, 128, 1, 4, 1, "dot_t"), 16, 128)
    with pytest.raises(ValueError, match="variant"):
        check_config(GemvConfig(16, 16, 128, 1, 4, 1, "dot"), 16, 128)
    # a narrow layer (TP 8's shards) splits K to fill the GPU
    assert default_config(1, 512, 4096, 128, 132).split_k == 16 and default_config(2, 512, 4096, 128, 132).split_k == 2
