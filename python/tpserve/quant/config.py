"""A checkpoint's ``quantization_config``: FP8 weights with block scales (Qwen's and DeepSeek's ``fp8``), with one
scale per tensor (the older ``fp8`` without ``weight_block_size``) or as compressed-tensors writes them (llm-compressor's
FP8 schemes: a scale per output channel, per tensor or per block); or the quantization asked for at load time
(``--quantization fp8``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

QUANTIZATION_METHODS = ("fp8",)  # applied at load to an unquantized checkpoint
QUANTIZATION_CHOICES = (*QUANTIZATION_METHODS, "compressed-tensors")  # --quantization, as vLLM's (a format names itself)
ONLINE_BLOCK_SIZE = (128, 128)  # the weights sharing one scale when tpserve quantizes at load time
_KNOWN_KEYS = {
    "quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
    "ignored_layers", "modules_to_convert", "scale_fmt", "dequantize",
}


# A row-scaled (per-channel or per-tensor) checkpoint's block in its QuantConfig; each layer holds such scales as
# [rows, 1], one (1, K) block a row over its own K inputs (layers.linear, layers.moe)
ROW_BLOCK = (1, 128)
_COMPRESSED_TENSORS_KEYS = {
    "quant_method", "format", "config_groups", "ignore", "kv_cache_scheme", "quantization_status",
    "global_compression_ratio", "sparsity_config", "version", "transform_config",
}


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8": float8_e4m3fn weights
    block_size: tuple[int, int]  # (output rows, input columns) of weights sharing one float32 scale
    prequantized: bool  # the checkpoint holds the FP8 weights and scales (else quantized at load time)
    not_converted: tuple[str, ...] = ()  # module-name patterns left unquantized (modules_to_not_convert)
    # The checkpoint's scales: "block" (one a block_size block), "channel" (one an output row) or "tensor" (one a
    # tensor). tpserve holds the last two as one scale a row (any tensor-parallel cut): ``row_scales``.
    scales: str = "block"
    scale_name: str = "weight_scale_inv"  # the checkpoint's scale tensors (compressed-tensors': weight_scale)
    compressed_tensors: bool = False  # llm-compressor's format: its ``ignore`` rules and key names

    @property
    def row_scales(self) -> bool:
        return self.scales != "block"

    @property
    def ignore_key(self) -> str:
        """config.json's key listing the unquantized modules."""
        return "ignore" if self.compressed_tensors else "modules_to_not_convert"

    @property
    def block_key(self) -> str:
        return "config_groups.<group>.weights.block_structure" if self.compressed_tensors else "weight_block_size"

    def converts(self, module: str) -> bool:
        """Whether the checkpoint module ``module`` is quantized. A pattern matches as in transformers: from the start
        up to a module boundary (as a regular expression too), or as a suffix; compressed-tensors' ``ignore`` as it
        matches: a full module name, or ``re:`` and a regular expression matched from the start (``re.match``)."""
        if self.compressed_tensors:
            return not any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in self.not_converted)
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(
            re.match(rf"(?:{pattern}){boundary}", module) or module.endswith(pattern) for pattern in self.not_converted
        )


def _error(key: str, message: str) -> ValueError:
    return ValueError(f"config.json quantization_config.{key}: {message}")


def _block_size(value: Any, key: str = "weight_block_size") -> tuple[int, int]:
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise _error(key, f"must be two positive integers [rows, columns], got {value!r}")
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
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method not in QUANTIZATION_METHODS:
        raise _error("quant_method", f"{method!r} is not supported (supported: {', '.join(QUANTIZATION_METHODS)}, "
                     "compressed-tensors)")
    unknown = sorted(set(raw) - _KNOWN_KEYS)
    if unknown:
        raise _error(unknown[0], f"is not supported for quant_method fp8 (tpserve reads {', '.join(sorted(_KNOWN_KEYS))})")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise _error("fmt", f"{raw['fmt']!r} is not supported (only e4m3: float8_e4m3fn weights)")
    if str(raw.get("activation_scheme", "dynamic")).lower() not in ("dynamic", "static"):
        raise _error("activation_scheme", f"{raw['activation_scheme']!r} is not supported (dynamic or static)")
    if raw.get("scale_fmt", "float") != "float":
        raise _error("scale_fmt", f"{raw['scale_fmt']!r} is not supported (only float: float32 scales)")
    if raw.get("modules_to_convert"):
        raise _error("modules_to_convert", "quantized embeddings are not supported")
    if raw.get("weight_block_size") is None:
        # one scale a tensor: vLLM's weight_scale (and input_scale where static), or transformers' 0-d weight_scale_inv
        # (and activation_scale); the activation scales are not read
        return QuantConfig(method, ROW_BLOCK, True, _patterns(raw), scales="tensor", scale_name="weight_scale")
    if str(raw.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise _error("activation_scheme", f"{raw['activation_scheme']!r} is not supported with weight_block_size "
                     "(block-scaled FP8 quantizes activations dynamically)")
    return QuantConfig(
        method=method, block_size=_block_size(raw["weight_block_size"]), prequantized=True, not_converted=_patterns(raw),
    )


def _compressed_tensors(raw: dict[str, Any]) -> QuantConfig:
    """llm-compressor's FP8 checkpoints (FP8, FP8_DYNAMIC, FP8_BLOCK): one config group of 8-bit float weights on the
    Linear layers, scaled per channel, tensor or block (``weight_scale``). Activations are quantized per token and
    128 features as tpserve's FP8 GEMMs do, whatever the group says (a static ``input_scale`` is not read)."""
    def error(key: str, message: str) -> ValueError:
        return _error(key, message + " (tpserve reads compressed-tensors' FP8 weight schemes)")

    unknown = sorted(set(raw) - _COMPRESSED_TENSORS_KEYS)
    if unknown:
        raise error(unknown[0], "is not supported")
    if raw.get("format") not in ("float-quantized", "naive-quantized"):
        raise error("format", f"{raw.get('format')!r} is not supported (float-quantized or naive-quantized)")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if raw.get(key):
            raise error(key, "is not supported (null or empty only)")
    if raw.get("quantization_status", "compressed") != "compressed":
        raise error("quantization_status", f"{raw['quantization_status']!r} is not supported (compressed: the weights "
                    "saved in FP8)")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise error("config_groups", f"must hold exactly one group, got {groups!r}")
    (name, group), = groups.items()
    key = f"config_groups.{name}"
    if not isinstance(group, dict):
        raise error(key, f"must be an object (targets, weights, input_activations), got {group!r}")
    if group.get("targets") != ["Linear"]:
        raise error(f"{key}.targets", f"must be [\"Linear\"], got {group.get('targets')!r}")
    if group.get("format") not in (None, "float-quantized", "naive-quantized"):
        raise error(f"{key}.format", f"{group['format']!r} is not supported (float-quantized or naive-quantized)")
    weights = group.get("weights")
    if not isinstance(weights, dict) or weights.get("num_bits") != 8 or str(weights.get("type")).lower() != "float":
        raise error(f"{key}.weights", f"must be 8-bit float (FP8 e4m3) weights, got {weights!r}")
    if not weights.get("symmetric", True) or weights.get("dynamic"):
        raise error(f"{key}.weights", "must be symmetric with static scales")
    strategy = str(weights.get("strategy")).lower()
    if strategy not in ("channel", "tensor", "block"):
        raise error(f"{key}.weights.strategy", f"{weights.get('strategy')!r} is not supported (channel, tensor or block)")
    activations = group.get("input_activations")
    if activations is not None and (not isinstance(activations, dict) or activations.get("num_bits") != 8
                                    or str(activations.get("type")).lower() != "float"):
        raise error(f"{key}.input_activations", f"must be 8-bit float or null, got {activations!r}")
    if group.get("output_activations") is not None:
        raise error(f"{key}.output_activations", "must be null")
    ignore = raw.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(v, str) for v in ignore):
        raise error("ignore", f"must be a list of module names, got {ignore!r}")
    for pattern in ignore:  # a module's full name, or "re:" and a regular expression
        try:
            re.compile(pattern[3:] if pattern.startswith("re:") else "")
        except re.error as e:
            raise error("ignore", f"{pattern!r} is not a valid pattern ({e})") from e
    block, scales = ROW_BLOCK, strategy
    if strategy == "block":
        structure = weights.get("block_structure")
        if isinstance(structure, str) and re.fullmatch(r"\d+x\d+", structure):  # the older "128x128" spelling
            structure = [int(v) for v in structure.split("x")]
        block = _block_size(structure, f"{key}.weights.block_structure")
    return QuantConfig("fp8", block, True, tuple(ignore), scales=scales, scale_name="weight_scale",
                       compressed_tensors=True)


def check_quantization_name(asked: str | None) -> None:
    """``--quantization``'s value: a method tpserve applies at load, or a checkpoint format (vLLM's
    ``compressed-tensors``, which names what the checkpoint holds)."""
    if asked is not None and asked not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {asked!r}")


def resolve_quantization(asked: str | None, checkpoint: QuantConfig | None) -> QuantConfig | None:
    """The checkpoint's own quantization, or ``asked`` applied at load time to an unquantized one."""
    check_quantization_name(asked)
    if checkpoint is not None:
        held = "compressed-tensors" if checkpoint.compressed_tensors else checkpoint.method
        if asked is not None and asked not in (checkpoint.method, held):
            raise ValueError(f"the checkpoint is quantized with {held}; it cannot be served as {asked}")
        return checkpoint
    if asked is None:
        return None
    if asked not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {asked} reads a checkpoint saved so (llm-compressor's), and this one has no "
                         f"quantization_config; {', '.join(QUANTIZATION_METHODS)} quantizes it at load")
    return QuantConfig(method=asked, block_size=ONLINE_BLOCK_SIZE, prequantized=False)
