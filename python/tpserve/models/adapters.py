"""LoRA adapters (PEFT checkpoints: ``adapter_config.json`` and ``adapter_model.safetensors``), as vLLM serves them:
each adapter has a slot in every layer it adapts (slot 0: none), and a step's tokens add
``scale * B_slot @ A_slot @ x`` to the layer's output for the slot their request names.

The adapters' A and B are sharded as the layer's weight: a column-parallel layer keeps A whole and its rows of B,
a row-parallel layer its columns of A and all of B (the partial sums are then all-reduced with the layer's own).
A merged layer (q/k/v, gate/up) stacks its parts' A and places each part's B on its own rows and rank columns.
Every rank reads its shard of an adapter into host memory at the same point of its schedule (the --lora-modules
adapters at start, others when the server's /v1/load_lora_adapter asks) and copies it into a slot when a request
needs it there (``engine/lora_slots.py`` keeps which slot holds what)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn

from tpserve.layers.linear import ParallelLinear
from tpserve.layers.lora import LoRAWeights
from tpserve.models.checkpoint import open_safetensors

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# the layers an adapter may adapt, by the checkpoint's module names (tpserve merges q/k/v and gate/up)
# (and Phi-3's fused qkv_proj and gate_up_proj, as its checkpoints and so its PEFT adapters name them)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
_PARTS = {"q_proj": ("qkv_proj", "q", 0), "k_proj": ("qkv_proj", "k", 1), "v_proj": ("qkv_proj", "v", 2),
          "gate_proj": ("gate_up_proj", 0, 0), "up_proj": ("gate_up_proj", 1, 1),
          "o_proj": ("o_proj", None, 0), "down_proj": ("down_proj", None, 0)}
# a fused module's adapter (one A, B over all its parts' rows) is each part's: A copied into every part's ranks, B cut
# into the parts' rows; so its delta B @ A @ x is the same, rank x parts columns computed
_FUSED = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}
_NUM_PARTS = {"qkv_proj": 3, "gate_up_proj": 2, "o_proj": 1, "down_proj": 1}


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scale: float  # lora_alpha / rank (/ sqrt(rank) with rsLoRA)
    targets: frozenset[str]


def read_adapter_config(path: str, max_rank: int) -> AdapterConfig:
    """A PEFT adapter's settings; a ValueError names what tpserve cannot serve."""
    config_file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(config_file) or not os.path.isfile(os.path.join(path, ADAPTER_WEIGHTS)):
        raise ValueError(f"LoRA adapter {path}: needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} (a PEFT checkpoint)")
    with open(config_file) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path}: {ADAPTER_CONFIG} must hold a JSON object")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {path}: r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"LoRA adapter {path}: lora_alpha must be a number, got {alpha!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {path} has rank {rank}, more than --max-lora-rank {max_rank}")
    unserved = [key for key in ("use_dora", "modules_to_save", "layers_to_transform") if config.get(key)]
    if config.get("bias", "none") != "none":
        unserved.append("bias")
    if unserved:
        raise ValueError(f"LoRA adapter {path}: {', '.join(unserved)} is not served")
    # the layers it adapts are its tensors' (as vLLM reads them): target_modules may be a regex, "all-linear" or full
    # module paths; a list still names its modules (the last part of each)
    named = config.get("target_modules") or []
    if not isinstance(named, (str, list)) or not all(isinstance(target, str) for target in named):
        raise ValueError(f"LoRA adapter {path}: target_modules must be a string or a list of strings, got {named!r}")
    named = set() if isinstance(named, str) else {target.rpartition(".")[2] for target in named}
    with open_safetensors(os.path.join(path, ADAPTER_WEIGHTS)) as tensors:
        targets = {name.partition(".lora_")[0].rpartition(".")[2] for name in tensors.keys()}
    others = sorted((named | targets) - set(TARGETS))
    if others:
        raise ValueError(f"LoRA adapter {path} adapts {', '.join(others)}: tpserve adapts only {', '.join(TARGETS)}")
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return AdapterConfig(rank, scale, frozenset(targets))


def attach_lora(model: nn.Module, slots: int, max_rank: int, device: torch.device,
                dtype: torch.dtype) -> dict[str, ParallelLinear]:
    """Give every layer of ``model`` (a CausalLM) an adapter may adapt ``slots`` zeroed adapter slots (1 to
    ``slots``; 0 is the base model's), allocated once here: loads copy into them. Returns those layers by name."""
    layers = {name: module for name, module in model.named_modules()  # not a MoE block's shared expert
              if isinstance(module, ParallelLinear) and name.rpartition(".")[2] in _NUM_PARTS
              and ".shared_expert." not in name}
    for name, module in layers.items():
        module.lora = LoRAWeights(slots + 1, _NUM_PARTS[name.rpartition(".")[2]], max_rank,
                                  module.in_features, module.out_features, device, dtype)
    return layers


@dataclass(frozen=True)
class _Write:
    """One piece of an adapter: ``value`` goes to ``index`` of a slot of ``layer``'s A (``kind`` "a") or B."""

    layer: ParallelLinear
    kind: str
    index: tuple[slice, ...]
    value: torch.Tensor


@dataclass(frozen=True)
class AdapterWeights:
    """This rank's shard of an adapter, in host memory (pinned beside a GPU), as ``install_adapter`` writes it."""

    writes: tuple[_Write, ...]

    @property
    def nbytes(self) -> int:
        return sum(write.value.nbytes for write in self.writes)


def read_adapter(layers: dict[str, ParallelLinear], path: str, config: AdapterConfig, pin: bool) -> AdapterWeights:
    """This rank's shard of the adapter at ``path`` for ``layers`` (``attach_lora``'s), in host memory. Every tensor
    is matched to its layer and checked before the adapter is used."""
    writes = []
    with open_safetensors(os.path.join(path, ADAPTER_WEIGHTS)) as tensors:
        targets = [(name, *_target_layer(layers, name, path)) for name in tensors.keys()]
        for name, layer, shard_id, part, kind in targets:
            for piece_shard, piece_part, piece in _parts(layer, shard_id, part, kind, tensors.get_tensor(name), name):
                write = _write(layer, piece, name, piece_shard, piece_part, kind, config)
                slot_shape = (layer.lora.a if write.kind == "a" else layer.lora.b)[0][write.index].shape
                if write.value.shape != slot_shape:  # checked here: a slot is filled mid-schedule, at an admission
                    raise ValueError(f"LoRA adapter tensor {name} has shape {tuple(piece.shape)}: this model's "
                                     f"layer takes {tuple(slot_shape)} (this rank's shard)")
                writes.append(replace(write, value=write.value.pin_memory()) if pin else write)
    return AdapterWeights(tuple(writes))


def install_adapter(layers: dict[str, ParallelLinear], slot: int, weights: AdapterWeights) -> None:
    """Copy an adapter into ``slot`` of ``layers``, replacing what the slot held (in stream order on a GPU: after
    the steps already launched)."""
    clear_slot(layers, slot)
    for write in weights.writes:
        lora: LoRAWeights = write.layer.lora
        target = lora.a if write.kind == "a" else lora.b
        target[slot][write.index].copy_(write.value, non_blocking=True)
        lora.filled.add(slot)


def clear_slot(layers: dict[str, ParallelLinear], slot: int) -> None:
    for layer in layers.values():
        layer.lora.clear(slot)


def _target_layer(layers: dict[str, ParallelLinear], name: str,
                  path: str) -> tuple[ParallelLinear, str | int | tuple | None, int, str]:
    """(the layer, its shard id, the part of it, lora_A or lora_B) a PEFT tensor adapts; a fused module's shard id is
    its parts' (``_parts`` cuts it)."""
    module_name, kind = _adapter_target(name, path)
    parent, _, leaf = module_name.rpartition(".")
    merged, shard_id, part = _PARTS[leaf] if leaf in _PARTS else (leaf, _FUSED[leaf], 0)
    layer = layers.get(f"{parent}.{merged}")
    if layer is None:
        raise ValueError(f"LoRA adapter {path}: {name} adapts a layer this model does not have (or one "
                         "tpserve does not adapt: MoE experts)")
    return layer, shard_id, part, kind


def _parts(layer: ParallelLinear, shard_id: str | int | tuple | None, part: int, kind: str, loaded: torch.Tensor,
           name: str) -> Iterator[tuple[str | int | None, int, torch.Tensor]]:
    """(shard id, part, tensor) of each part a PEFT tensor adapts: itself, or a fused module's parts (its A for each
    part, its B cut into the parts' rows, as the checkpoint's fused weight is)."""
    if not isinstance(shard_id, tuple):
        yield shard_id, part, loaded
        return
    if kind == "lora_A":
        yield from ((shard, index, loaded) for index, shard in enumerate(shard_id))
        return
    sizes = list(layer.checkpoint_rows(shard_id))
    if loaded.dim() != 2 or loaded.shape[0] != sum(sizes):
        raise ValueError(f"LoRA adapter tensor {name} has shape {tuple(loaded.shape)}: its rows should be the "
                         f"{sum(sizes)} of the fused module's parts {tuple(sizes)}")
    yield from ((shard, index, piece) for index, (shard, piece) in enumerate(zip(shard_id, loaded.split(sizes))))


def _write(layer: ParallelLinear, loaded: torch.Tensor, name: str, shard_id: str | int | None, part: int,
           kind: str, config: AdapterConfig) -> _Write:
    lora: LoRAWeights = layer.lora
    rank_dim = 0 if kind == "lora_A" else 1
    if loaded.dim() != 2 or loaded.shape[rank_dim] != config.rank:
        raise ValueError(f"LoRA adapter tensor {name} has shape {tuple(loaded.shape)}: its "
                         f"{'rows' if rank_dim == 0 else 'columns'} must be the adapter's r ({config.rank})")
    rows = slice(part * lora.max_rank, part * lora.max_rank + config.rank)
    if kind == "lora_A":
        if layer.split_dim == 1:  # row-parallel: this rank's inputs
            loaded = layer.part(None).cut(loaded, 1, 2, name)
        return _Write(layer, "a", (rows,), loaded.to(lora.a.dtype, copy=True).contiguous())
    piece = layer.part(shard_id) if layer.split_dim == 0 else None
    # scaled in float32, then rounded once (a bf16 adapter too); a Granite layer's residual_multiplier too
    loaded = loaded.float() * (config.scale * layer.output_multiplier)
    if piece is not None:
        loaded, out_rows = piece.cut(loaded, 0, 2, name), slice(piece.dest, piece.dest + piece.size)
    else:
        out_rows = slice(None)
    return _Write(layer, "b", (out_rows, rows), loaded.to(lora.b.dtype).contiguous())


def _adapter_target(name: str, path: str) -> tuple[str, str]:
    """(the checkpoint's module name, lora_A or lora_B) of a PEFT tensor name."""
    stem = name.removeprefix("base_model.model.")
    module, _, rest = stem.partition(".lora_")
    if not rest or rest not in ("A.weight", "B.weight") or module.rpartition(".")[2] not in TARGETS:
        raise ValueError(f"LoRA adapter {path}: unexpected tensor {name}")
    if not module.startswith("model."):
        module = "model." + module
    return module, "lora_" + rest[0]
