"""How checkpoints spell tensor and module names: the bare decoder's without ``model.``, Mixtral's MoE block in its own
words; tpserve's modules take Qwen's (``canonical_name``), and errors and ``modules_to_not_convert`` speak the
checkpoint's (``spelled_for``, ``converted``)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tpserve.quant.config import QuantConfig

# The decoder's own modules, which a checkpoint of the bare decoder (transformers' Qwen3Model and kin, as
# sentence-transformers saves embedding models) names without the "model." of *ForCausalLM's
_DECODER_MODULES = ("embed_tokens.", "layers.", "norm.")


# Mixtral's checkpoints name a layer's MoE block and its experts' projections otherwise (as transformers' conversion
# mapping reads them): (Mixtral's spelling, the one tpserve's modules use)
_MIXTRAL_SPELLING = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))
_MIXTRAL_EXPERT = re.compile(r"(?P<expert>\.experts\.\d+)(?P<proj>\.w[123]\.)")


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name as *ForCausalLM's checkpoints spell it (Mixtral's MoE names as Qwen's)."""
    name = name.removeprefix("language_model.")
    name = "model." + name if name.startswith(_DECODER_MODULES) else name
    if ".block_sparse_moe." in name:
        name = name.replace(*_MIXTRAL_SPELLING[0])
        name = _MIXTRAL_EXPERT.sub(lambda m: m["expert"] + dict(_MIXTRAL_SPELLING[1:])[m["proj"]], name)
    return name


# Phi-3's checkpoints hold the parts tpserve's checkpoint_name names apart in one tensor
_PHI3_FUSED = re.compile(r"\.(?:q_proj|k_proj|v_proj)\.|\.(?:gate_proj|up_proj)\.")


def spelled_for(architecture: str, name: str) -> str:
    """A module or tensor name of tpserve's model as ``architecture``'s checkpoints spell it (Mixtral's MoE block,
    Phi-3's fused projections)."""
    if architecture.startswith("Phi3"):
        return _PHI3_FUSED.sub(lambda m: ".qkv_proj." if m[0][1] in "qkv" else ".gate_up_proj.", name)
    if not architecture.startswith("Mixtral") or ".mlp." not in name:
        return name
    name = name.replace(".mlp.", ".block_sparse_moe.")
    for mixtral, ours in _MIXTRAL_SPELLING[1:]:
        name = re.sub(rf"(\.experts\.\d+){re.escape(ours)}", rf"\g<1>{mixtral}", name)
    return name


def converted(quant: QuantConfig, architecture: str, module: str) -> bool:
    """Whether ``quant`` converts tpserve's ``module``: left out where ``modules_to_not_convert`` names it in either
    spelling (transformers reads Mixtral's patterns in both: its own, and the checkpoint's)."""
    return quant.converts(module) and quant.converts(spelled_for(architecture, module))
