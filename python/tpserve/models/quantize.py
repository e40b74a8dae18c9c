"""Which linear layers of a model hold FP8 weights."""

from __future__ import annotations

from torch import nn

from tpserve.layers.linear import ParallelLinear
from tpserve.models.loader import checkpoint_parts
from tpserve.quant.config import QuantConfig


def quantize_model(model: nn.Module, quant: QuantConfig) -> None:
    """Mark the linear layers ``quant`` converts (all but modules_to_not_convert, named as in the
    checkpoint); on the meta device, before the parameters are materialised."""
    for name, module in model.named_modules():
        if not isinstance(module, ParallelLinear):
            continue
        parts = checkpoint_parts(name)
        converted = [quant.converts(part) for part in parts]
        if all(converted):
            module.use_fp8(quant.block_size, quant.prequantized)
        elif any(converted):
            kept = [p for p, c in zip(parts, converted) if not c]
            raise ValueError(
                f"quantization_config.modules_to_not_convert keeps {', '.join(kept)} unquantized but not the rest of "
                f"{', '.join(parts)}; tpserve computes them in one matmul ({name}), so they must all be quantized or none"
            )

