"""A checkpoint's ``quantization_config`` (FP8 with block scales, as Qwen and DeepSeek publish
it), or the quantization asked for at load time (``--quantization fp8``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

QUANTIZATION_METHODS = ("fp8",)
ONLINE_BLOCK_SIZE = (128, 128)  # the weights sharing one scale when tpserve quantizes at load time
_KNOWN_KEYS = {
    "quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
    "ignored_layers", "modules_to_convert", "scale_fmt", "dequantize",
}


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8": float8_e4m3fn weights
    block_size: tuple[int, int]  # (output rows, input columns) of weights sharing one float32 scale
    prequantized: bool  # the checkpoint holds the FP8 weights and scales (else quantized at load time)
    not_converted: tuple[str, ...] = ()  # module-name patterns left unquantized (modules_to_not_convert)

    def converts(self, module: str) -> bool:
        """Whether the checkpoint module ``module`` is quantized; a pattern matches as in transformers:
        from the start up to a module boundary (as a regular expression too), or as a suffix."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(
            re.match(rf"(?:{pattern}){boundary}", module) or module.endswith(pattern) for pattern in self.not_converted
        )


def _error(key: str, message: str) -> ValueError:
    return ValueError(f"config.json quantization_config.{key}: {message}")


def _block_size(value: Any) -> tuple[int, int]:
    if value is None:
        raise _error("weight_block_size", "null (one scale per tensor) is not supported; tpserve reads block-scaled FP8")
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise _error("weight_block_size", f"must be two positive integers [rows, columns], got {value!r}")
    return int(value[0]), int(value[1])


def _patterns(raw: dict[str, Any]) -> tuple[str, ...]:
    key = "modules_to_not_convert" if raw.get("modules_to_not_convert") is not None else "ignored_layers"
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _error(key, f"must be a list of module names, got {value!r}")
    for pattern in value:
        try:
            re.compile(pattern)
        except re.error as e:
            raise _error(key, f"{pattern!r} is not a valid pattern ({e})") from e
    return tuple(value)


def parse_quantization_config(raw: Any) -> QuantConfig:
    """config.json's ``quantization_config``; anything tpserve does not implement is an error naming the key."""
    if not isinstance(raw, dict):
        raise ValueError(f"config.json quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method not in QUANTIZATION_METHODS:
        raise _error("quant_method", f"{method!r} is not supported (supported: {', '.join(QUANTIZATION_METHODS)})")
    unknown = sorted(set(raw) - _KNOWN_KEYS)
    if unknown:
        raise _error(unknown[0], f"is not supported for quant_method fp8 (tpserve reads {', '.join(sorted(_KNOWN_KEYS))})")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise _error("fmt", f"{raw['fmt']!r} is not supported (only e4m3: float8_e4m3fn weights)")
    if str(raw.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise _error("activation_scheme", f"{raw['activation_scheme']!r} is not supported (only dynamic)")
    if raw.get("scale_fmt", "float") != "float":
        raise _error("scale_fmt", f"{raw['scale_fmt']!r} is not supported (only float: float32 scales)")
    if raw.get("modules_to_convert"):
        raise _error("modules_to_convert", "quantized embeddings are not supported")
    return QuantConfig(
        method=method, block_size=_block_size(raw.get("weight_block_size", [128, 128])), prequantized=True,
        not_converted=_patterns(raw),
    )


def resolve_quantization(asked: str | None, checkpoint: QuantConfig | None) -> QuantConfig | None:
    """The checkpoint's own quantization, or ``asked`` applied at load time to an unquantized one."""
    if asked is not None and asked not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {asked!r}")
    if checkpoint is not None:
        if asked is not None and asked != checkpoint.method:
            raise ValueError(f"the checkpoint is quantized with {checkpoint.method}; it cannot be served as {asked}")
        return checkpoint
    if asked is None:
        return None
    return QuantConfig(method=asked, block_size=ONLINE_BLOCK_SIZE, prequantized=False)
