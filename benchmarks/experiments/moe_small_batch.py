"""One sparse layer's experts at decode batches: the grouped GEMMs against the small-batch kernels.

For a mixture-of-experts config (Qwen3-30B-A3B by default; random bf16 weights, one tensor-parallel
rank's slice with --tp), each batch size times ``grouped_experts`` (sort by expert, two grouped
GEMMs, SiLU-and-mul, sum over k) and ``small_batch_experts`` (``tpserve.kernels.moe_small``: two
unsorted GEMV-style kernels) with its default config. Every timing is the replay of one CUDA graph
of --calls calls (``time_in_graph``), each call with its own random routing and one of --copies
copies of the layer's weights, so the experts a call reads come from HBM, not L2; the floor is
the bytes of the distinct experts each call reads over the device copy bandwidth measured in the
same run. Each path is checked once against the float32 torch experts.

Then a sweep of each small-batch kernel's launch config at --sweep-batch-sizes: BLOCK_N, BLOCK_K,
warps (and experts read per step, for down) at 2 stages, then the stages of the best; each kernel
timed alone (down on the activations of the default gate_up). It prints the best config per
batch, the best summed over the sweep's batches (a ``SmallBatchConfig`` to paste into
``moe_small.default_config``), and the experts' time with it.

    python benchmarks/experiments/moe_small_batch.py --model tests/data/configs/Qwen3-30B-A3B \\
        --batch-sizes 1,4,16,64 --out out/moe_small_batch.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import os
import sys
import time
from collections.abc import Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))  # benchmarks/common.py
if importlib.util.find_spec("tpserve") is None:
    sys.path.insert(0, os.path.join(_ROOT, "python"))

import torch
import triton
from common import copy_bandwidth, device_name, print_table, write_json
from tpserve.kernels.moe import grouped_experts
from tpserve.kernels.moe_small import KernelConfig, SmallBatchConfig, default_config, down_sum, gate_up_silu, small_batch_experts
from tpserve.layers.moe import experts_torch
from tpserve.plan.calibrate import time_in_graph

DTYPE = torch.bfloat16
TOLERANCE = 2e-2  # relative L2 error against float32; bf16 rounding alone is ~4e-3
MAX_ACC_PER_THREAD = 128  # float32 accumulators per thread past which a config would spill: not swept


def gate_up_sweep() -> list[KernelConfig]:
    configs = []
    for block_n, block_k, warps in itertools.product((8, 16, 32), (128, 256, 512), (2, 4, 8)):
        if 2 * block_n * block_k <= MAX_ACC_PER_THREAD * 32 * warps:  # gate and up accumulators
            configs.append(KernelConfig(block_n, block_k, warps))
    return configs


def down_sweep(top_k: int) -> list[KernelConfig]:
    configs = []
    per_step = sorted({min(e, triton.next_power_of_2(top_k)) for e in (1, 4, 8)})
    for block_n, block_k, warps, experts in itertools.product((4, 8, 16), (64, 128, 256), (4, 8), per_step):
        if experts * block_n * block_k <= MAX_ACC_PER_THREAD * 32 * warps:
            configs.append(KernelConfig(block_n, block_k, warps, experts_per_step=experts))
    return configs


def with_stages(config: KernelConfig) -> list[KernelConfig]:
    return [dataclasses.replace(config, num_stages=s) for s in (1, 3, 4) if s != config.num_stages]


@dataclasses.dataclass
class Layer:
    """``copies`` copies of one sparse layer's experts and ``calls`` random routings of a batch."""

    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    xs: list[torch.Tensor]
    weights: list[torch.Tensor]
    ids: list[torch.Tensor]

    def args(self, call: int) -> tuple[torch.Tensor, ...]:
        copy = call % len(self.gate_up)
        return self.xs[call], self.gate_up[copy], self.down[copy], self.weights[call], self.ids[call]


def make_routings(layer: Layer, tokens: int, experts: int, top_k: int, hidden: int, calls: int, seed: int) -> Layer:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    xs, weights, ids = [], [], []
    for _ in range(calls):
        xs.append(torch.randn(tokens, hidden, generator=gen, device="cuda").to(DTYPE))
        probs = torch.softmax(torch.randn(tokens, experts, generator=gen, device="cuda"), dim=-1)
        w, i = torch.topk(probs, top_k, dim=-1)
        weights.append((w / w.sum(-1, keepdim=True)).to(DTYPE))
        ids.append(i)
    return dataclasses.replace(layer, xs=xs, weights=weights, ids=ids)


def timed(fn: Callable[[int], object], calls: int, iters: int) -> float:
    """Seconds per call of ``fn(call)`` over one graph of ``calls`` calls, each on its own inputs."""
    turn = itertools.count()
    return time_in_graph(lambda: fn(next(turn) % calls), iters, repeat=calls)


def rel_err(got: torch.Tensor, layer: Layer) -> float:
    x, gate_up, down, weights, ids = layer.args(0)
    expected = experts_torch(x.float(), gate_up.float(), down.float(), weights.float(), ids)
    return float((got.float() - expected).norm() / expected.norm())


def measure(name: str, fn: Callable[[int], object], layer: Layer, args: argparse.Namespace, check: bool) -> dict:
    """{"us", "first_call_s"[, "err"]} or {"error"}: a config that fails or is wrong is skipped."""
    try:
        start = time.perf_counter()
        out = fn(0)
        torch.cuda.synchronize()
        result = {"first_call_s": time.perf_counter() - start}
        if check:
            result["err"] = rel_err(out, layer)
            if not result["err"] < TOLERANCE:
                return {"error": f"relative error {result['err']:.3g}"}
        result["us"] = timed(fn, args.calls, args.iters) * 1e6
        return result
    except Exception as exc:  # noqa: BLE001 -- reported, and the sweep goes on
        message = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}"
        print(f"    {name}: FAILED {message}", flush=True)
        return {"error": message}


def sweep_kernel(
    name: str, configs: list[KernelConfig], run: Callable[[KernelConfig, int], object], layer: Layer,
    args: argparse.Namespace,
) -> dict[KernelConfig, float]:
    """Microseconds of every config that ran, then the stages of the fastest."""
    times: dict[KernelConfig, float] = {}

    def try_all(candidates: list[KernelConfig]) -> None:
        for config in candidates:
            result = measure(f"{name} {config}", lambda call, c=config: run(c, call), layer, args, check=False)
            if "us" in result:
                times[config] = result["us"]

    try_all(configs)
    if times:
        try_all(with_stages(min(times, key=times.__getitem__)))
    return times


def summed_best(per_batch: list[dict[KernelConfig, float]]) -> KernelConfig | None:
    """The config with the least time summed over the batches where every one ran."""
    common = set.intersection(*(set(t) for t in per_batch)) if per_batch else set()
    return min(common, key=lambda c: sum(t[c] for t in per_batch)) if common else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.path.join(_ROOT, "tests/data/configs/Qwen3-30B-A3B"),
                        help="a directory with a mixture-of-experts config.json")
    parser.add_argument("--tp", type=int, default=1, help="time one tensor-parallel rank's slice of the experts")
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--sweep-batch-sizes", default="1,4,8", help="empty: no sweep")
    parser.add_argument("--copies", type=int, default=4, help="copies of the layer's experts, rotated over the calls")
    parser.add_argument("--calls", type=int, default=8, help="calls (routings) per graph")
    parser.add_argument("--iters", type=int, default=20, help="timed graph replays")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False

    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    experts, top_k, hidden = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"]
    if cfg["moe_intermediate_size"] % args.tp:
        raise SystemExit(f"moe_intermediate_size {cfg['moe_intermediate_size']} does not split over tp {args.tp}")
    inter = cfg["moe_intermediate_size"] // args.tp
    expert_bytes = 3 * hidden * inter * DTYPE.itemsize
    bandwidth = copy_bandwidth()
    print(f"{device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; {experts} experts, top {top_k}, "
          f"hidden {hidden}, intermediate {inter} (tp {args.tp}), {expert_bytes / 1e6:.2f} MB an expert", flush=True)

    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = Layer(
        gate_up=[(torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") / hidden**0.5).to(DTYPE)
                 for _ in range(args.copies)],
        down=[(torch.randn(experts, hidden, inter, generator=gen, device="cuda") / inter**0.5).to(DTYPE)
              for _ in range(args.copies)],
        xs=[], weights=[], ids=[],
    )
    default = default_config(top_k)

    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        batch_layer = make_routings(layer, batch, experts, top_k, hidden, args.calls, seed=batch)
        distinct = sum(len(set(i.flatten().tolist())) for i in batch_layer.ids) / args.calls
        floor_us = distinct * expert_bytes / bandwidth * 1e6
        grouped = measure("grouped", lambda c, bl=batch_layer: grouped_experts(*bl.args(c)), batch_layer, args, True)
        small = measure("small", lambda c, bl=batch_layer: small_batch_experts(*bl.args(c), default), batch_layer, args, True)
        row = {"batch": batch, "rows": batch * top_k, "experts_read": distinct, "floor_us": floor_us,
               "grouped_us": grouped.get("us", float("nan")), "small_us": small.get("us", float("nan")),
               "grouped_err": grouped.get("err", float("nan")), "small_err": small.get("err", float("nan"))}
        row["speedup"] = row["grouped_us"] / row["small_us"]
        row["small_x_floor"] = row["small_us"] / floor_us
        row["small_TBps"] = distinct * expert_bytes / row["small_us"] / 1e6
        rows.append(row)
        print(f"batch {batch}: grouped {row['grouped_us']:.1f} us, small {row['small_us']:.1f} us, "
              f"floor {floor_us:.1f} us", flush=True)
    print(f"\nOne layer's experts per call, default small-batch config {default}")
    print_table(rows, ["batch", "rows", "experts_read", "floor_us", "grouped_us", "small_us", "speedup",
                       "small_x_floor", "small_TBps", "grouped_err", "small_err"])

    sweep_batches = [int(b) for b in args.sweep_batch_sizes.split(",") if b]
    sweeps, gate_up_times, down_times = [], [], []
    for batch in sweep_batches:
        batch_layer = make_routings(layer, batch, experts, top_k, hidden, args.calls, seed=1000 + batch)
        acts = [gate_up_silu(x, gu, ids, default.gate_up) for x, gu, _, _, ids in map(batch_layer.args, range(args.calls))]

        def run_gate_up(config: KernelConfig, call: int, bl: Layer = batch_layer) -> torch.Tensor:
            x, gate_up, _, _, ids = bl.args(call)
            return gate_up_silu(x, gate_up, ids, config)

        def run_down(config: KernelConfig, call: int, bl: Layer = batch_layer, acts: list = acts) -> torch.Tensor:
            _, _, down, weights, ids = bl.args(call)
            return down_sum(acts[call], down, weights, ids, config)

        print(f"\nsweep at batch {batch}", flush=True)
        gate_up_times.append(sweep_kernel("gate_up", gate_up_sweep(), run_gate_up, batch_layer, args))
        down_times.append(sweep_kernel("down", down_sweep(top_k), run_down, batch_layer, args))
        for kernel, times in (("gate_up", gate_up_times[-1]), ("down", down_times[-1])):
            ranked = sorted(times, key=times.__getitem__)
            default_us = times.get(getattr(default, kernel), float("nan"))
            sweeps += [{"batch": batch, "kernel": kernel, "rank": r + 1, "config": str(c), "us": times[c],
                        "vs_default": default_us / times[c]} for r, c in enumerate(ranked[:5])]
            print(f"  {kernel}: {len(times)} configs ran; best {times[ranked[0]]:.1f} us ({ranked[0]}), "
                  f"default {default_us:.1f} us" if ranked else f"  {kernel}: no config ran", flush=True)
    best = None
    if sweeps:
        print("\nThe five fastest configs of each kernel per batch (vs_default = default time / this time)")
        print_table(sweeps, ["batch", "kernel", "rank", "us", "vs_default", "config"])
        best_gate_up, best_down = summed_best(gate_up_times), summed_best(down_times)
        if best_gate_up and best_down:
            best = SmallBatchConfig(best_gate_up, best_down)
            print(f"\nbest over batches {sweep_batches}: {best}")
            for row in rows:
                batch_layer = make_routings(layer, row["batch"], experts, top_k, hidden, args.calls, seed=row["batch"])
                tuned = measure("best", lambda c, bl=batch_layer: small_batch_experts(*bl.args(c), best), batch_layer, args, True)
                row["best_us"] = tuned.get("us", float("nan"))
                row["best_x_floor"] = row["best_us"] / row["floor_us"]
            print_table(rows, ["batch", "floor_us", "grouped_us", "small_us", "best_us", "best_x_floor"])
    write_json(args.out, {
        "benchmark": "moe_small_batch", "model": args.model, "tp": args.tp, "copy_bandwidth_Bps": bandwidth,
        "experts": experts, "top_k": top_k, "hidden": hidden, "intermediate": inter,
        "default_config": str(default), "best_config": str(best) if best else None, "rows": rows, "sweep": sweeps,
    })


if __name__ == "__main__":
    main()
