"""Weight loading: mark the FP8 layers, then stream safetensors one tensor at a time to (module,
parameter, shard id) targets that keep only their rank's shard (so the extra host memory is about
one tensor). Experts come per expert or stacked (transformers' layout), both read per expert."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator

import torch
from torch import nn
from tqdm import tqdm

from tpserve.layers.linear import ParallelLinear
from tpserve.layers.norm import RMSNorm
from tpserve.layers.moe import StackedExperts, holds_whole_experts
from tpserve.models.checkpoint import open_safetensors, safetensors_files
from tpserve.models.names import canonical_name, converted, spelled_for
from tpserve.models.decoder import CausalLM
from tpserve.quant.config import QuantConfig
from tpserve.quant.fp8 import FP8_DTYPE, FP8_MAX

logger = logging.getLogger(__name__)

_MERGED_PARTS = {  # merged parameter -> {checkpoint projection: shard id}
    "qkv_proj": {"q_proj": "q", "k_proj": "k", "v_proj": "v"},
    "gate_up_proj": {"gate_proj": 0, "up_proj": 1},
}
_MERGED = {part: (merged, shard_id) for merged, parts in _MERGED_PARTS.items() for part, shard_id in parts.items()}
_SHARDS = {merged: tuple(parts.values()) for merged, parts in _MERGED_PARTS.items()}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_EXPERT = re.compile(r"(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<kind>weight|weight_scale_inv)")
_STACKED_EXPERTS = re.compile(r"(?P<module>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)")
_EXPERT_PARTS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}

ShardId = str | int | tuple[int, int] | None  # tuple: (expert, part) of stacked experts
Target = tuple[str, str, ShardId]  # (module path, parameter name, shard id)


def checkpoint_target(name: str) -> Target:
    name = canonical_name(name)
    expert = _EXPERT.fullmatch(name)
    if expert:
        param, part = _EXPERT_PARTS[expert["proj"]]
        suffix = "_scale_inv" if expert["kind"] == "weight_scale_inv" else ""
        return expert["module"], param + suffix, (int(expert["expert"]), part)
    module, _, param = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    if leaf in _MERGED:
        merged, shard_id = _MERGED[leaf]
        return f"{parent}.{merged}", param, shard_id
    return module, param, None


def checkpoint_name(target: Target) -> str:
    """The checkpoint tensor that loads ``target`` (the inverse of ``checkpoint_target``; experts as
    per-expert tensors)."""
    module, param, shard_id = target
    if isinstance(shard_id, tuple):  # (expert, part) of stacked experts
        expert, part = shard_id
        merged, scale = param.removesuffix("_scale_inv"), param.endswith("_scale_inv")
        proj = next(p for p, (m, i) in _EXPERT_PARTS.items() if (m, i) == (merged, part))
        return f"{module}.{expert}.{proj}.{'weight_scale_inv' if scale else 'weight'}"
    parent, _, leaf = module.rpartition(".")
    if leaf in _MERGED_PARTS:
        part = next(p for p, i in _MERGED_PARTS[leaf].items() if i == shard_id)
        return f"{parent}.{part}.{param}"
    return f"{module}.{param}"


def checkpoint_parts(module: str) -> tuple[str, ...]:
    """The checkpoint modules loaded into ``module`` (``...qkv_proj`` -> ``...q_proj``, ``k_proj``, ``v_proj``)."""
    parent, _, leaf = module.rpartition(".")
    return tuple(f"{parent}.{part}" for part in _MERGED_PARTS[leaf]) if leaf in _MERGED_PARTS else (module,)


def quantize_model(model: nn.Module, quant: QuantConfig) -> None:
    """Mark the linear layers and experts ``quant`` converts (by checkpoint name) before materialising."""
    architecture = model.config.architecture if isinstance(model, CausalLM) else ""
    for name, module in model.named_modules():
        if isinstance(module, StackedExperts) and converted(quant, architecture, name):
            kept = [e for e in range(module.total_experts) if not converted(quant, architecture, f"{name}.{e}")]
            if kept:
                raise ValueError(
                    f"quantization_config.{quant.ignore_key} keeps expert(s) {kept[:8]} of {spelled_for(architecture, name)} unquantized but "
                    "not the others; tpserve holds a layer's experts in one tensor, so they must all be quantized or none"
                )
            module.use_fp8(quant.block_size, quant.row_scales, quant.prequantized)
        if not isinstance(module, ParallelLinear):
            continue
        parts = checkpoint_parts(name)
        converts = [converted(quant, architecture, part) for part in parts]
        if all(converts):
            module.use_fp8(quant.block_size, quant.prequantized, quant.row_scales)
        elif any(converts):
            kept = [spelled_for(architecture, p) for p, c in zip(parts, converts) if not c]
            raise ValueError(
                f"quantization_config.{quant.ignore_key} keeps {', '.join(kept)} unquantized but not the rest of "
                f"{', '.join(spelled_for(architecture, p) for p in parts)}; tpserve computes them in one matmul ({name}), so "
                "they must all be quantized or none"
            )


def checkpoint_pieces(name: str, tensor: torch.Tensor, model: nn.Module | None = None
                      ) -> Iterator[tuple[Target, torch.Tensor]]:
    """The (target, tensor) pairs of one checkpoint tensor: itself, or views of each expert's pieces, or of each part
    of a projection the checkpoint fuses (Phi-3's ``qkv_proj`` and ``gate_up_proj``, given the ``model`` whose layer
    says each part's rows), so each part is sharded as the checkpoints with separate parts are."""
    canonical = canonical_name(name)
    module, _, param = canonical.rpartition(".")
    leaf = module.rpartition(".")[2]
    layer = _merged_layer(model, module) if leaf in _SHARDS and param in ("weight", "bias") else None
    if layer is not None:
        sizes = layer.checkpoint_rows(_SHARDS[leaf])
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, not the {sum(sizes)} of its fused "
                             f"parts {sizes} config.json describes")
        for shard_id, piece in zip(_SHARDS[leaf], tensor.split(sizes, dim=0)):
            yield (module, param, shard_id), piece
        return
    stacked = _STACKED_EXPERTS.fullmatch(canonical)
    if stacked is None:
        yield checkpoint_target(name), tensor
        return
    module, param = stacked["module"], stacked["proj"]
    for expert in range(tensor.shape[0]):
        if param == "gate_up_proj":
            gate, up = tensor[expert].chunk(2, dim=0)
            yield (module, param, (expert, 0)), gate
            yield (module, param, (expert, 1)), up
        else:
            yield (module, param, (expert, 0)), tensor[expert]


def expected_targets(model: nn.Module) -> set[Target]:
    """Every (module, parameter, shard) the checkpoint must provide."""
    expected: set[Target] = set()
    for full_name, _ in model.named_parameters():  # tied weights are listed once
        module, _, param = full_name.rpartition(".")
        shard_ids = getattr(model.get_submodule(module), "shard_ids", None)
        shards = shard_ids(param) if shard_ids is not None else _SHARDS.get(module.rpartition(".")[2], (None,))
        for shard_id in shards:
            expected.add((module, param, shard_id))
    return expected


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Allocate storage for a model built on the meta device, in ``dtype`` but for ``keep_dtype``."""
    for module in model.modules():
        keep = getattr(module, "keep_dtype", ())
        for name, param in module.named_parameters(recurse=False):
            if param.is_floating_point() and name not in keep and param.dtype != dtype:
                setattr(module, name, nn.Parameter(param.data.to(dtype), requires_grad=False))
    model.to_empty(device=device)
    if isinstance(model, CausalLM) and model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty breaks the tie


def _iter_checkpoint(
    files: list[str], show_progress: bool, skip: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors but those ``skip`` names, which are not read."""
    handles = [open_safetensors(path) for path in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show_progress) as bar:
        for handle in handles:
            for name in handle.keys():
                if not skip(name):
                    yield name, handle.get_tensor(name)
                bar.update(1)


def _held_elsewhere(model: nn.Module, target: Target) -> bool:
    """Whether ``target`` is another rank's (an expert under expert parallelism: ``StackedExperts``)."""
    try:
        module = model.get_submodule(target[0])
    except AttributeError:
        return False
    held_elsewhere = getattr(module, "held_elsewhere", None)
    return held_elsewhere is not None and held_elsewhere(target[2])


def load_safetensors(model: CausalLM, model_dir: str, show_progress: bool = False) -> None:
    expected = expected_targets(model)
    loaded: set[Target] = set()
    tied = model.config.tie_word_embeddings

    expert_parallel = holds_whole_experts(model)

    tied_head: torch.Tensor | None = None  # the checkpoint's own lm_head.weight, where config.json ties it
    # classifier_from_token: the score head is made of these rows of the LM head (or of the tied embedding)
    classifier = model.config.classifier
    score_tokens = [] if classifier is None else list(classifier.token_ids)
    head_rows: dict[str, torch.Tensor] = {}
    if score_tokens:
        expected.discard(("score", "weight", None))

    # compressed-tensors' and per-tensor FP8 checkpoints name their scales weight_scale (read as weight_scale_inv: both
    # multiply) and may hold static activation scales (vLLM's input_scale, transformers' activation_scale), not read:
    # tpserve quantizes activations per token
    quant = model.config.quantization
    scale_renamed = quant is not None and quant.scale_name == "weight_scale"

    # transformers' Qwen2-MoE builds its shared expert even 0 wide (0-row tensors, and a gate whose product is 0): tpserve
    # builds none, so those tensors are not read
    moe = model.config.moe
    no_shared = moe is not None and moe.shared_intermediate_size == 0 and model.config.architecture.startswith("Qwen2Moe")

    def skip(name: str) -> bool:  # per-expert tensors of other ranks are not even read
        if name.endswith(_IGNORED_SUFFIXES) or scale_renamed and name.endswith((".input_scale", ".activation_scale")):
            return True
        if no_shared and (".mlp.shared_expert." in name or ".mlp.shared_expert_gate." in name):
            return True
        return expert_parallel and _held_elsewhere(model, checkpoint_target(name))

    fused = model if model.config.fused_projections else None
    for source, tensor in _iter_checkpoint(safetensors_files(model_dir), show_progress, skip):
        name = source + "_inv" if scale_renamed and source.endswith(".weight_scale") else source
        head = canonical_name(name)
        if score_tokens and head in ("lm_head.weight", "model.embed_tokens.weight"):
            head_rows[head] = _rows(name, tensor, score_tokens)
            if head == "lm_head.weight":  # the classifier has no LM head: only these rows are kept
                continue
        if tied and name == "lm_head.weight":
            tied_head = tensor
            continue
        for target, piece in checkpoint_pieces(name, tensor, fused):
            if target not in expected:
                if _held_elsewhere(model, target):  # a stacked tensor's other experts
                    continue
                raise ValueError(
                    f"unexpected weight {source!r} in the checkpoint (no parameter {target[0]}.{target[1]}"
                    + (f" for shard {target[2]})" if target[2] is not None else ")")
                )
            if target in loaded:
                raise ValueError(f"weight {source!r} appears twice in the checkpoint")
            module, param, shard_id = target
            layer = model.get_submodule(module)
            if not piece.is_floating_point():  # copying an integer tensor would convert it silently
                raise ValueError(f"checkpoint tensor {source!r} is {str(piece.dtype).removeprefix('torch.')}, not a "
                                 "floating-point weight")
            if getattr(layer, "quantizes_on_load", False):  # held FP8, loaded in the compute dtype and quantized
                if piece.dtype.itemsize == 1:
                    raise ValueError(f"checkpoint tensor {source!r} is {str(piece.dtype).removeprefix('torch.')}, but "
                                     "config.json has no quantization_config: --quantization fp8 quantizes a checkpoint "
                                     "of unquantized weights at load")
            else:
                _check_float8(source, piece.dtype, getattr(layer, param).dtype, quant.ignore_key if quant else "")
            try:
                with torch.no_grad():
                    layer.load_weight(param, piece, shard_id)
            except ValueError as e:  # the layer's message names its parameter, not the checkpoint's tensor
                raise ValueError(
                    f"checkpoint tensor {source!r} of shape {tuple(tensor.shape)} does not fit the model config.json "
                    f"describes: {e}"
                ) from None
            loaded.add(target)
        del tensor
    missing = expected - loaded
    if missing:
        names = sorted({spelled_for(model.config.architecture, checkpoint_name(target)) for target in missing})
        if scale_renamed:
            names = [n.removesuffix("_inv") if n.endswith(".weight_scale_inv") else n for n in names]
        raise ValueError(f"weights missing from the checkpoint: {', '.join(names[:10])}" + (" ..." if len(names) > 10 else ""))
    if tied_head is not None:
        _untie_if_different(model, tied_head)
    if score_tokens:
        rows = head_rows.get("lm_head.weight", head_rows.get("model.embed_tokens.weight"))
        # two tokens: sigmoid((yes - no) . h) is the softmax of the two logits' yes; the difference taken in float32
        model.score.load_weight("weight", rows[1:] - rows[:1] if classifier.two_way else rows)


def _merged_layer(model: nn.Module | None, module: str) -> ParallelLinear | None:
    """``model``'s merged layer (q/k/v, gate/up) at ``module``, which a fused checkpoint tensor fills; None: none."""
    try:
        layer = None if model is None else model.get_submodule(module)
    except AttributeError:  # not a module of this model: the unexpected-weight error names the tensor
        return None
    return layer if isinstance(layer, ParallelLinear) else None


def _rows(name: str, tensor: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """classifier_from_token's rows of an LM head (or embedding) tensor, in float32."""
    if max(token_ids) >= tensor.shape[0]:
        raise ValueError(f"classifier_from_token id {max(token_ids)} is past the {tensor.shape[0]} rows of {name!r}")
    return tensor[token_ids].float()


def _check_float8(name: str, stored: torch.dtype, held: torch.dtype, ignore_key: str) -> None:
    """A float8 tensor only where tpserve holds float8_e4m3fn, and one there (a copy would convert it silently)."""
    stored_fp8, held_fp8 = stored.itemsize == 1, held == FP8_DTYPE
    dtype = str(stored).removeprefix("torch.")
    if stored_fp8 and not held_fp8:
        raise ValueError(f"checkpoint tensor {name!r} is {dtype}, but tpserve holds it in {str(held).removeprefix('torch.')}"
                         f" (config.json has no quantization_config, its {ignore_key or 'modules_to_not_convert'} lists the module, or "
                         "the tensor is never quantized: a scale, a norm, a MoE router)")
    if held_fp8 and stored != FP8_DTYPE:
        raise ValueError(f"checkpoint tensor {name!r} is {dtype}, but config.json's quantization_config (fmt e4m3) makes "
                         "it float8_e4m3fn" + ("" if stored_fp8 else f": list its module in {ignore_key} if "
                                               "the checkpoint keeps it unquantized"))


def _untie_if_different(model: CausalLM, head: torch.Tensor) -> None:
    """config.json ties the LM head to the embeddings, yet the checkpoint has an lm_head.weight: where it differs,
    transformers unties them and computes the logits with it (``PreTrainedModel.tie_weights``), so tpserve does."""
    embed, lm_head = model.model.embed_tokens, model.lm_head
    lm_head.weight = nn.Parameter(torch.empty_like(embed.weight), requires_grad=False)
    try:
        with torch.no_grad():
            lm_head.load_weight("weight", head)
    except ValueError as e:
        raise ValueError(f"checkpoint tensor 'lm_head.weight' of shape {tuple(head.shape)} does not fit the model "
                         f"config.json describes: {e}") from None
    if torch.equal(lm_head.weight, embed.weight):
        lm_head.weight = embed.weight
    else:
        logger.warning("config.json ties the LM head to the embeddings (tie_word_embeddings), but the checkpoint's "
                       "lm_head.weight differs from them: it is used, untied, as transformers does")


def init_dummy(model: CausalLM, seed: int) -> None:
    """Random weights from config.json alone, for speed work on real shapes."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("scale_inv"):
                param.fill_(0.02)
            elif param.dtype == FP8_DTYPE:  # N(0, 1) x scale_inv 0.02: the other weights' std
                param.copy_(torch.empty(param.shape, device=param.device).normal_(generator=generator).clamp_(-FP8_MAX, FP8_MAX))
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)


def fold_residual_multiplier(model: CausalLM) -> None:
    """Granite's residual_multiplier, folded into the projections whose outputs join the residual stream (o_proj,
    down_proj): ``residual + m * (W x + b)`` is ``residual + (m W) x + m b``, so the fused GEMVs that add their output
    to the residual need no change. An FP8 weight's scales take it. Its LoRA adapters' B take it too
    (``output_multiplier``, read by ``models/adapters.py``)."""
    m = model.config.residual_multiplier
    if m == 1.0:
        return
    with torch.no_grad():
        for name, module in model.named_modules():
            if not (isinstance(module, ParallelLinear) and name.endswith((".o_proj", ".down_proj"))):
                continue
            (module.weight if module.weight_scale_inv is None else module.weight_scale_inv).mul_(m)
            if module.bias is not None:
                module.bias.mul_(m)
            module.output_multiplier = m


def fold_norm_weight_offset(model: CausalLM) -> None:
    """Gemma's RMSNorms multiply by (1 + weight) in float32: the offset is added to every norm weight once, so the
    norm kernels (and the GEMVs and all-reduces that fuse a norm) need no change. In float32 this is exact: transformers
    computes the same float32 sum, ``1.0 + weight.float()``, then the same product. In half precision the sum is rounded
    to the compute dtype once (as any norm weight is) and, as for every model, tpserve multiplies after rounding the
    normed input, where transformers' Gemma rounds after the product."""
    offset = model.config.norm_weight_offset
    if offset == 0.0:
        return
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.copy_(module.weight.float() + offset)


def load_model_weights(
    model: CausalLM, model_dir: str, load_format: str, device: torch.device, dtype: torch.dtype, seed: int, show_progress: bool
) -> None:
    materialize(model, device, dtype)
    if load_format == "dummy":
        init_dummy(model, seed)
    else:
        load_safetensors(model, model_dir, show_progress)
        fold_norm_weight_offset(model)  # (init_dummy's norms are 1 already)
    fold_residual_multiplier(model)
    for module in model.modules():
        finish_loading = getattr(module, "finish_loading", None)
        if finish_loading is not None:
            finish_loading(dtype)
    if device.type == "cuda":  # weights replaced by their FP8 form: give the memory back for the KV cache
        torch.cuda.empty_cache()
    model.build_rotary_caches(device, dtype)
