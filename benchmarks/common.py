"""Shared by the benchmarks: the device's ceilings measured in the same run, engine set-up,
model byte/FLOP counts, tables and JSON output."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch
from tpserve.engine_config import EngineConfig
from tpserve.distributed.comm import local_init_addr
from tpserve.distributed.spawn import on_spawned_ranks
from tpserve.engine.engine import Engine
from tpserve.engine.sampler import SamplingBatch
from tpserve.forward import SequenceInput
from tpserve.layers.moe import StackedExperts
from tpserve.plan import calibrate


def setup_logging() -> None:
    """Show the engine's start-up log (backend, KV pages, CUDA graph sizes, capture time)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def time_cuda(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of ``fn`` on the current stream, timed with CUDA events."""
    return calibrate.time_device(fn, torch.device("cuda"), iters, warmup)


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (bf16)."""
    return calibrate.copy_bandwidth(torch.device("cuda"), int(gib * 2**30), iters=20)


def matmul_peak(n: int = 8192) -> float:
    """bf16 matmul FLOP/s on random inputs."""
    return calibrate.matmul_flops(torch.device("cuda"), n, iters=30)


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set in os.environ inside the block (an engine built there, and its CUDA graphs, keep
    what the variables chose), the previous values back after it."""
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def make_engine(model: str, **overrides) -> Engine:
    config = EngineConfig(model=model, load_format="dummy", dtype="bfloat16", **overrides)
    return Engine(config)


RANK_TIMEOUT_S = 900


def _on_engine(rank: int, config: EngineConfig, body: Callable, args: tuple) -> object:
    engine = Engine(config, rank)
    result = body(engine, *args)
    engine.shutdown()
    return result


def on_ranks(config: EngineConfig, body: Callable, *args: object) -> object:
    """Run ``body(engine, *args)`` on every TP rank (one spawned process each, the way the server
    starts them) and return rank 0's result. Every rank must make the same collective calls."""
    if config.tp_size > 1:
        config = replace(config, dist_init_addr=local_init_addr())
    return on_spawned_ranks(_on_engine, config.tp_size, config, body, args, timeout_s=RANK_TIMEOUT_S)[0]


def engine_step(engine: Engine, seqs: list[SequenceInput], sampling: SamplingBatch) -> list[int]:
    """One step, synchronous: forward, sampling and the host sync (the samples)."""
    return engine.launch(seqs, sampling).result()


def expected_touched_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts a sparse layer reads for ``tokens`` tokens, each picking ``top_k`` of
    ``num_experts``, expected under uniform routing (random weights route about uniformly)."""
    if not tokens:
        return 0.0
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def expert_bytes(engine: Engine) -> int:
    """Bytes of every expert of every sparse layer on this rank (0 for a dense model)."""
    return sum(
        p.numel() * p.element_size() for m in engine.model.modules() if isinstance(m, StackedExperts)
        for p in m.parameters()
    )


def weight_bytes_per_decode_step(engine: Engine, batch_size: int) -> float:
    """Parameter bytes a decode step reads: every weight once, but an untied input embedding
    only for the batch's rows and, in a mixture-of-experts model, only the experts the batch's
    tokens are routed to (expected under uniform routing)."""
    model = engine.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    moe = engine.model_config.moe
    if moe is not None:
        experts = expert_bytes(engine)
        touched = expected_touched_experts(moe.num_experts, moe.top_k, batch_size) / moe.num_experts
        total -= experts * (1 - touched)
    embed = model.model.embed_tokens.weight
    if engine.model_config.tie_word_embeddings:
        return total
    row_bytes = embed.shape[1] * embed.element_size()
    return total - embed.numel() * embed.element_size() + batch_size * row_bytes


def kv_bytes_per_token(engine: Engine) -> int:
    cfg = engine.model_config
    return 2 * cfg.num_hidden_layers * engine.num_kv_heads * cfg.head_dim * engine.kv_pool.dtype.itemsize  # FP8 caches: 1


def prefill_flops(engine: Engine, tokens: int) -> float:
    """Matmul FLOPs of one causal prefill: 2 per weight per token for the decoder layers, plus
    QK^T and PV over the causal triangle. The LM head runs on the last token only."""
    cfg = engine.model_config
    layer_weights = sum(p.numel() for p in engine.model.model.layers.parameters() if p.dim() == 2)
    linear = 2 * layer_weights * tokens + 2 * cfg.vocab_size * cfg.hidden_size
    heads = engine.num_heads
    attention = cfg.num_hidden_layers * 2 * 2 * heads * cfg.head_dim * tokens * (tokens + 1) / 2
    return linear + attention


def fill_kv_randomly(engine: Engine) -> None:
    """Timings never run on a zero cache."""
    gen = torch.Generator(device=engine.device).manual_seed(0)
    for k, v in zip(engine.kv_pool.k, engine.kv_pool.v):
        for cache in (k, v):
            if cache.dtype == engine.kv_pool.compute_dtype:
                cache.normal_(generator=gen)
            else:  # an FP8 cache: torch draws no float8
                cache.copy_(torch.randn(cache.shape, generator=gen, device=cache.device, dtype=engine.kv_pool.compute_dtype))


def trace_kernels(prof: torch.profiler.profile) -> list[dict]:
    """The GPU kernels a finished profiler saw, by start time: chrome-trace events with ``name``,
    ``ts`` and ``dur`` in microseconds (CUPTI times each kernel of a graph replay too)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    return sorted(events, key=lambda e: e["ts"])


def print_table(rows: Sequence[dict], columns: Sequence[str]) -> None:
    def fmt(value: object) -> str:
        if isinstance(value, float):
            return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
        return str(value)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    from tpserve import kernels

    payload = {"date": time.strftime("%Y-%m-%d"), "gpu": device_name(), "fused_kernels": kernels.ENABLED, **payload}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
