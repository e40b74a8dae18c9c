"""The CUDA GEMV's argument checks (``kernels.gemv.unsupported``), which run without a GPU: the
shapes and dtypes it refuses with a reason, so callers can fall back."""

from __future__ import annotations

import pytest
import torch

from tpserve.kernels.gemv import MAX_TOKENS, gemv, unsupported
from tpserve.quant.fp8 import quantize_blocks


def test_unsupported_names_the_reason():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    w = torch.zeros(384, 256, dtype=torch.bfloat16)
    wq, scale = quantize_blocks(w, (128, 128))
    assert "CUDA device" in unsupported(x, w) and "CUDA device" in unsupported(x, wq, scale)
    assert "rows of x" in unsupported(torch.zeros(MAX_TOKENS + 1, 256, dtype=torch.bfloat16), w)
    assert "rows of x" in unsupported(torch.zeros(0, 256, dtype=torch.bfloat16), w)
    assert "bf16" in unsupported(x.float(), w) and "float8_e4m3fn" in unsupported(x, w, scale)
    assert "multiple of 8" in unsupported(x[:, :36].contiguous(), w[:, :36].contiguous())
    assert "multiple of 16" in unsupported(x[:, :40].contiguous(), wq[:, :40].contiguous(), scale[:, :1].contiguous())
    assert "scale_inv" in unsupported(x, wq, scale[:, :1].contiguous())
    assert "contiguous [N, K]" in unsupported(x, w.t())
    assert "multiple of 8" in unsupported(x, w[:380], silu_mul=True)  # SwiGLU pairs gate and up rows
    assert "rows of x" in unsupported(torch.zeros(3, 256, dtype=torch.bfloat16), w, silu_mul=True)
    assert "CUDA device" in unsupported(x, w, silu_mul=True)  # the shapes pass: only the device is left
    with pytest.raises(ValueError, match="gemv: .*rows of x"):
        gemv(torch.zeros(9, 256, dtype=torch.bfloat16), w)


def test_row_scales_take_one_token_and_a_scale_a_row():
    """``row_scales`` (compressed-tensors' per-channel FP8): scale_inv [N, 1], one token, FP8 weights."""
    w = torch.zeros(384, 256, dtype=torch.float8_e4m3fn)
    rows, blocks = torch.ones(384, 1), torch.ones(3, 2)
    one, two = torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(2, 256, dtype=torch.bfloat16)
    assert "CUDA device" in unsupported(one, w, rows, row_scales=True)  # the shapes pass: only the device is left
    assert "CUDA device" in unsupported(one, w, rows, silu_mul=True, fused=True, row_scales=True)
    assert "rows of x" in unsupported(two, w, rows, row_scales=True)
    assert "[384, 1] (a row's scale)" in unsupported(one, w, blocks, row_scales=True)
    assert "[384, 1] (a row's scale)" in unsupported(one, w, torch.ones(384, 2), row_scales=True)  # the old repeats
    assert "[3, 2] (128x128 blocks)" in unsupported(one, w, rows)
    assert "needs FP8 weights" in unsupported(one, torch.zeros(384, 256, dtype=torch.bfloat16), row_scales=True)


def test_jit_module_names_follow_the_source(tmp_path):
    """A changed kernel source gets a new module name, so FlashInfer never loads a carried
    prebuilt module (its AOT directory is looked up by name alone) of an older source."""
    from tpserve.kernels import jit_name

    source = tmp_path / "k.cu"
    source.write_text("__global__ void k() {}\n")
    first = jit_name("tpserve_k", source)
    assert first.startswith("tpserve_k_") and jit_name("tpserve_k", source) == first
    source.write_text("__global__ void k() { }\n")
    assert jit_name("tpserve_k", source) != first


def test_linear_takes_the_gemv_only_at_few_tokens_when_enabled(monkeypatch):
    """``gemv.linear`` (bf16 linears, the LM head, the MoE router): the GEMV at 1..BF16_GEMV_TOKENS
    rows when the layer enabled it at load, ``F.linear`` otherwise; the bias added either way."""
    import torch

    from tpserve.kernels import gemv

    calls = []
    monkeypatch.setattr(gemv, "gemv", lambda x, w: calls.append(x.shape[:-1]) or torch.nn.functional.linear(x, w))
    w, b = torch.randn(6, 4), torch.randn(6)
    for rows in (1, gemv.BF16_GEMV_TOKENS, gemv.BF16_GEMV_TOKENS + 1):
        x = torch.randn(rows, 4)
        for enabled in (True, False):
            torch.testing.assert_close(gemv.linear(x, w, enabled, b), torch.nn.functional.linear(x, w, b))
    assert calls == [(1,), (gemv.BF16_GEMV_TOKENS,)]


def test_defines_variant_setting():
    from tpserve.kernels.gemv import DEFINES_ENV, _defines

    assert _defines("") == ()
    assert _defines("FP8_LOADS=16 FP8_ROWS=8") == _defines("FP8_LOADS=16,FP8_ROWS=8") == (("FP8_LOADS", 16), ("FP8_ROWS", 8))
    with pytest.raises(ValueError, match=DEFINES_ENV):
        _defines("FP8_LOADS=sixteen")


def test_expert_gemv_refusals_name_the_reason():
    """``gemv.experts`` (the one-token MoE experts, ``TPSERVE_MOE_GEMV=1``) says why it cannot run, so the MoE
    layer keeps the Triton or torch experts: at two tokens, past MAX_TOP_K, on unaligned sizes, FP8 scales in blocks
    other than 128 x 128 or a row's, on the CPU."""
    from tpserve.kernels.gemv import MAX_TOP_K, experts, experts_unsupported
    from tpserve.quant.fp8 import ExpertScales

    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    gate_up = torch.zeros(8, 2 * 128, 256, dtype=torch.bfloat16)
    down = torch.zeros(8, 256, 128, dtype=torch.bfloat16)
    logits = torch.zeros(1, 8, dtype=torch.bfloat16)
    assert "one bf16 token" in experts_unsupported(torch.zeros(2, 256, dtype=torch.bfloat16), gate_up, down, logits, 2)
    assert "one bf16 token" in experts_unsupported(x.float(), gate_up, down, logits, 2)
    assert "contiguous torch.bfloat16" in experts_unsupported(x, gate_up.float(), down, logits, 2)
    assert "contiguous torch.bfloat16" in experts_unsupported(x, gate_up.transpose(1, 2), down, logits, 2)
    assert "logits" in experts_unsupported(x, gate_up, down, logits.float(), 2)
    assert "logits" in experts_unsupported(x, gate_up, down, logits[:, :4], 2)
    assert "top_k" in experts_unsupported(x, gate_up, down, logits, MAX_TOP_K + 1)
    narrow = (x[:, :36].contiguous(), gate_up[:, :, :36].contiguous(), down[:, :36].contiguous())
    assert "multiple of 16" in experts_unsupported(*narrow, logits, 2)
    fp8 = (gate_up.to(torch.float8_e4m3fn), down.to(torch.float8_e4m3fn))
    scales = ExpertScales(torch.ones(8, 2, 1, 2), torch.ones(8, 2, 1), (128, 128))
    assert "CUDA device" in experts_unsupported(x, *fp8, logits, 2, scales)  # FP8 at 128 x 128: only the device left
    thin = ExpertScales(torch.ones(8, 2, 8, 8), torch.ones(8, 16, 8), (16, 32))
    assert "128x128" in experts_unsupported(x, *fp8, logits, 2, thin)
    assert "intermediate (96) of 128" in experts_unsupported(
        x, gate_up[:, :192].to(torch.float8_e4m3fn), down[:, :, :96].to(torch.float8_e4m3fn), logits, 2, scales)
    rows = ExpertScales(torch.ones(8, 2, 128, 1), torch.ones(8, 256, 1), (1, 256))  # a scale a row, as StackedExperts holds it
    assert "CUDA device" in experts_unsupported(x, *fp8, logits, 2, rows)
    narrow_rows = ExpertScales(torch.ones(8, 2, 96, 1), torch.ones(8, 256, 1), (1, 256))  # I = 96: 16-byte rows suffice
    assert "CUDA device" in experts_unsupported(
        x, gate_up[:, :192].to(torch.float8_e4m3fn), down[:, :, :96].to(torch.float8_e4m3fn), logits, 2, narrow_rows)
    wrong = ExpertScales(torch.ones(8, 2, 128, 2), torch.ones(8, 256, 1), (1, 128))
    assert ("scaled per row need scales [[8, 2, 128, 1], [8, 256, 1]], got [[8, 2, 128, 2], [8, 256, 1]]"
            in experts_unsupported(x, *fp8, logits, 2, wrong))
    assert "CUDA device" in experts_unsupported(x, gate_up, down, logits, 2)  # the shapes pass: only the device is left
    with pytest.raises(ValueError, match="expert gemv: .*CUDA device"):
        experts(x, gate_up, down, logits, 2, True)


@pytest.mark.parametrize("setting,fp8,expected", [("", True, True), ("", False, False), ("1", False, True),
                                                  ("0", True, False)])
def test_which_experts_take_the_expert_gemv(tiny_model_factory, monkeypatch, setting, fp8, expected):
    """``TPSERVE_MOE_GEMV`` read when a MoE block is built: by default only FP8 experts take the expert GEMVs at one
    token (bf16 ones were measured slower there and keep the Triton kernels); ``1`` sends bf16 too, ``0`` none."""
    from tpserve.config import ModelConfig
    from tpserve.distributed import info
    from tpserve.layers.moe import EXPERT_GEMV_ENV, SparseMoeBlock
    from tpserve.quant.fp8 import ExpertScales

    monkeypatch.setenv(EXPERT_GEMV_ENV, setting)
    monkeypatch.setattr(info, "_TP_INFO", info.TPInfo(0, 1))  # this process's TP info, restored after
    model_dir = tiny_model_factory("qwen3_moe", num_layers=2)
    block = SparseMoeBlock(ModelConfig.from_pretrained(model_dir), comm=None)
    scales = ExpertScales(torch.ones(4, 2, 1, 1), torch.ones(4, 1, 1), (128, 128)) if fp8 else None
    assert block.takes_expert_gemv(scales) == expected
