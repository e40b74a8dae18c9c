"""One function run on every rank, each in its own spawned process (calibration, benchmarks)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from typing import Any, Callable

JOIN_S = 60.0


def _rank_main(fn: Callable[..., Any], rank: int, args: tuple, out: mp.Queue) -> None:
    try:
        out.put((rank, fn(rank, *args), None))
    except Exception:
        out.put((rank, None, traceback.format_exc()))


def on_spawned_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float) -> list[Any]:
    """``fn(rank, *args)`` on ranks 0 .. world_size - 1; their results by rank. A rank that raises
    is a RuntimeError carrying its traceback; one that does not answer within ``timeout_s``, a
    TimeoutError."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, rank, args, out)) for rank in range(world_size)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            try:
                rank, result, error = out.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"a rank did not answer within {timeout_s:g} s") from None
            if error:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            results[rank] = result
    finally:
        for p in procs:
            p.join(JOIN_S)
            if p.is_alive():
                p.kill()
    return [results[rank] for rank in range(world_size)]
