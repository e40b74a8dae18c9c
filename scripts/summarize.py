"""Merge the benchmark JSON files of one run into one file and print a short table.

    python scripts/summarize.py RESULTS_DIR MERGED_JSON
"""

from __future__ import annotations

import glob
import json
import os
import sys


def main() -> None:
    results_dir, merged_path = sys.argv[1], sys.argv[2]
    merged = {}
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        with open(path) as f:
            merged[os.path.basename(path)[:-5]] = json.load(f)
    with open(merged_path, "w") as f:
        json.dump(merged, f, indent=2)

    lines = []
    for name, res in merged.items():
        kind = res.get("benchmark")
        if kind == "offline_throughput":
            lines.append(f"{name}: {res['output_tok_per_s']:,.0f} output tok/s ({res['seconds']:.1f} s, graphs<= {res['cuda_graph_max_bs']})")
        elif kind == "decode_latency":
            fused = "fused kernels" if res.get("fused_kernels", False) else "torch ops"
            lines.append(f"{name}: copy bw {res['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, {res['attention']}, {fused}")
            for row in res["rows"]:
                cells = [f"ctx {row['context']:>5} bs {row['batch']:>3} floor {row['floor_ms']:.2f} ms"]
                for mode in ("graph", "eager"):
                    if f"{mode}_ms" in row and isinstance(row[f"{mode}_ms"], float):
                        cells.append(f"{mode} {row[f'{mode}_ms']:.2f} ms ({row[f'{mode}_x_floor']:.2f}x)")
                lines.append("   " + ", ".join(cells))
        elif kind == "prefill_throughput":
            lines.append(f"{name}: matmul peak {res['matmul_peak_flops'] / 1e12:.0f} TFLOP/s, {res['attention']}")
            for row in res["rows"]:
                lines.append(
                    f"   {row['tokens']:>6} tokens: {row['ms']:.1f} ms, {row['tok_per_s']:,.0f} tok/s, MFU {row['MFU']:.2f}"
                )
        elif kind == "ceilings":
            lines.append(
                f"{name}: copy {res['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, "
                f"bf16 matmul {res['matmul_peak_flops'] / 1e12:.0f} TFLOP/s"
            )
        elif kind == "sampler_latency":
            lines.append(f"{name}: vocab {res['vocab']}")
            for row in res["rows"]:
                lines.append(
                    f"   bs {row['batch']:>3}: fused {row['fused_ms']:.3f} ms, torch {row['torch_ms']:.3f} ms, "
                    f"rows agreeing {row['agree']:.1%}"
                )
        elif kind == "profile_decode":
            lines.append(f"{name}: context {res['context']}")
            for row in res["rows"]:
                lines.append("   " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
        elif kind in ("allreduce_latency", "tp_decode_latency"):
            lines.append(f"{name}: TP {res['tp_size']}")
            for row in res["rows"]:
                lines.append("   " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
        elif kind == "moe_small_batch":
            lines.append(f"{name}: TP {res['tp']}, best config {res['best_config']}")
            for row in res["rows"]:
                best = f", best {row['best_us']:.1f} us" if "best_us" in row else ""
                lines.append(f"   bs {row['batch']:>3}: floor {row['floor_us']:.1f} us, grouped {row['grouped_us']:.1f} us, "
                             f"small {row['small_us']:.1f} us{best}")
        elif isinstance(res.get("results"), list) and "args" in res:  # serving.py
            for r in res["results"]:
                t, i = r["ttft_ms"], r["itl_ms"]
                server = f" {r['server']}" if r.get("server") else ""
                speedup = f" ({r['speedup_vs_dp1']:.2f}x DP 1)" if "speedup_vs_dp1" in r else ""
                lines.append(
                    f"{name}:{server} rate {r['rate']} ok {r['completed']}/{r['completed'] + r['failed']}, "
                    f"{r['output_throughput']:,.0f} out tok/s{speedup}, TTFT p50/p99 {t['p50']:.0f}/{t['p99']:.0f} ms, "
                    f"ITL p50/p99 {i['p50']:.1f}/{i['p99']:.1f} ms"
                )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
