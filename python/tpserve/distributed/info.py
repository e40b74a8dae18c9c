"""This process's tensor-parallel position. Set once per process, before any layer is built.

It is the one piece of per-process global state in tpserve: every parallel layer asks it for
its shard shape, exactly as every rank's process is built for one rank.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TPInfo:
    rank: int
    size: int
    # a MoE layer's experts split whole over the ranks (expert parallelism), not each expert's intermediate dim
    expert_parallel: bool = False


_TP_INFO: TPInfo | None = None


def set_tp_info(rank: int, size: int, expert_parallel: bool = False) -> TPInfo:
    global _TP_INFO
    if not 0 <= rank < size:
        raise ValueError(f"tp rank {rank} is outside [0, {size})")
    _TP_INFO = TPInfo(rank, size, expert_parallel)
    return _TP_INFO


def get_tp_info() -> TPInfo:
    if _TP_INFO is None:
        raise RuntimeError("set_tp_info(rank, size) must be called before building parallel layers")
    return _TP_INFO
