"""The operands tpserve hands torch's scaled matmul, checked on the CPU: their layouts pass torch's
own shape/stride checks (its meta kernels, the same rules as the CUDA ones), and read with
those layouts' meaning they compute the block GEMM's reference. Also the GPU GEMM choice and
the weight layouts each choice holds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpserve.kernels.fp8_linear import FP8_GEMM_ENV, backend_from_env, prepare_weight, weight_block
from tpserve.kernels.fp8_scaled_mm import (
    blockwise_operands,
    blockwise_reference,
    pad_block_scales,
    rowwise_reference,
)
from tpserve.quant.fp8 import FP8_DTYPE, fp8_linear_reference, quantize_blocks, weight_only_reference

BLOCK = (128, 128)


def outer_major(scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(scale.shape, (1, scale.shape[0]), dtype=scale.dtype, device=scale.device)
    out.copy_(scale)
    return out


@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (16, 4096, 12288), (64, 512, 384), (3, 256, 640)])
def test_blockwise_operands_pass_torch_checks(m, n, k):
    meta = torch.device("meta")
    xq = torch.empty(m, k, dtype=FP8_DTYPE, device=meta)
    xs = torch.empty_strided((m, -(-k // 128)), (1, m), dtype=torch.float32, device=meta)
    weight = torch.empty(n, k, dtype=FP8_DTYPE, device=meta)
    scale = torch.empty(-(-n // 128), -(-k // 128), dtype=torch.float32, device=meta)
    a, b, sa, sb = blockwise_operands(xq, xs, weight, pad_block_scales(scale))
    kinds = F.ScalingType
    out = F.scaled_mm(a, b, sa, kinds.BlockWise1x128, sb, kinds.BlockWise128x128, output_dtype=torch.bfloat16)
    assert out.shape == (m, n)
    # the layout of the first GPU run (scale_b not transposed, scale_a's strides from .t().contiguous().t())
    with pytest.raises(RuntimeError):
        F.scaled_mm(a, b, xs.t().contiguous().t(), kinds.BlockWise1x128, scale.t().contiguous().t(),
                    kinds.BlockWise128x128, output_dtype=torch.bfloat16)


def test_blockwise_operands_compute_the_block_gemm():
    gen = torch.Generator().manual_seed(0)
    m, n, k = 5, 300, 640  # partial weight blocks along N; K blocks 5, padded to 8
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    weight, scale = quantize_blocks(torch.randn(n, k, generator=gen) * 0.05, BLOCK)
    xq, xs = quantize_blocks(x, (1, 128))
    padded = pad_block_scales(scale)
    assert padded.shape == (3, 8) and torch.equal(padded[:, :5], scale)
    a, b, sa, sb = blockwise_operands(xq, outer_major(xs), weight, padded)
    assert sb.shape == (8, 3) and sb.stride() == (1, 8) and sa.stride() == (1, m)
    got = blockwise_reference(a, b, sa, sb, torch.float32)
    torch.testing.assert_close(got, fp8_linear_reference(x.float(), weight, scale, BLOCK), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="strides"):
        blockwise_operands(xq, xs, weight, padded)  # token-major activation scales


def test_rowwise_weights_and_operands():
    gen = torch.Generator().manual_seed(1)
    m, n, k = 4, 96, 256
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    weight, scale = quantize_blocks(w, BLOCK)
    rw, rs, block = prepare_weight("scaled_mm_rowwise", weight, scale, BLOCK)
    assert block == (1, k) == weight_block("scaled_mm_rowwise", BLOCK, k) and rs.shape == (n, 1)
    # re-quantized per row from the blocks: close to the block weights, not equal
    exact = x @ w.T
    err = float((weight_only_reference(x, rw, rs, block) - exact).norm() / exact.norm())
    assert err < 0.05
    meta = torch.device("meta")
    out = torch._scaled_mm(torch.empty(m, k, dtype=FP8_DTYPE, device=meta), rw.to(meta).t(), torch.empty(m, 1, device=meta),
                           rs.to(meta).t(), out_dtype=torch.bfloat16)
    assert out.shape == (m, n)
    xq, xs = quantize_blocks(x, (1, k))
    torch.testing.assert_close(rowwise_reference(xq, rw.t(), xs, rs.t(), torch.float32),
                               fp8_linear_reference(x, rw, rs, block), rtol=1e-5, atol=1e-5)


def test_prepare_weight_and_backend_choice(monkeypatch):
    weight, scale = quantize_blocks(torch.randn(256, 384), BLOCK)
    w, s, block = prepare_weight("scaled_mm", weight, scale, BLOCK)
    assert w is weight and s.shape == (2, 4) and block == BLOCK
    for backend in ("auto", "triton"):
        assert prepare_weight(backend, weight, scale, BLOCK)[1] is scale
    with pytest.raises(ValueError, match="128x128"):
        prepare_weight("scaled_mm", *quantize_blocks(torch.randn(64, 64), (32, 32)), (32, 32))
    monkeypatch.delenv(FP8_GEMM_ENV, raising=False)
    assert backend_from_env() == "auto"
    monkeypatch.setenv(FP8_GEMM_ENV, "cublas")
    with pytest.raises(ValueError, match=FP8_GEMM_ENV):
        backend_from_env()
