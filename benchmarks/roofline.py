"""Lower bounds on a traced offline run, step by step, next to the time each step took.

For every step of an ``offline_throughput.py --trace`` JSON (its sequences, new tokens and summed
context lengths), two floors over the measured ceilings:

* memory: the bytes the step must read (every weight once, every sequence's KV cache) over the
  device-copy bandwidth: the issue's roofline;
* compute-aware: the linear layers take the longer of reading their weights and doing their
  FLOPs (2 per weight per new token; the LM head only on each sequence's last token) at the
  measured bf16 matmul peak, plus the KV bytes over the bandwidth. Attention FLOPs are left out
  (under 2% of the linear FLOPs at these prompt lengths), so this is still a lower bound.

At batch 256 a Qwen3-14B decode step's linears do 7 TFLOP: at the matmul peak that is longer than
reading their 28 GB, so the memory roofline is not reachable there.

    python benchmarks/roofline.py docs/results/.../offline_qwen3_14b_traced.json \
        --model .models/Qwen3-14B --peak-tflops 766
"""

from __future__ import annotations

import argparse
import json

from tpserve.config import ModelConfig


def model_numbers(model_dir: str) -> tuple[int, int, int]:
    """(decoder-layer linear weights, LM-head weights, KV bytes per token) of a bf16 model."""
    cfg = ModelConfig.from_pretrained(model_dir)
    hidden, heads, kv_heads, head_dim = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * cfg.intermediate_size
    return cfg.num_hidden_layers * per_layer, cfg.vocab_size * hidden, 2 * cfg.num_hidden_layers * kv_heads * head_dim * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="JSON written by offline_throughput.py --trace")
    parser.add_argument("--model", required=True, help="the run's model directory (config.json)")
    parser.add_argument("--peak-tflops", type=float, required=True, help="bf16 matmul peak measured on the machine")
    parser.add_argument("--bandwidth-tbps", type=float, default=None,
                        help="copy bandwidth (default: the one the trace measured)")
    args = parser.parse_args()
    with open(args.trace) as f:
        run = json.load(f)
    trace = run["trace"]
    fields = trace["step_fields"]
    bandwidth = (args.bandwidth_tbps * 1e12) if args.bandwidth_tbps else run["copy_bandwidth_Bps"]
    peak = args.peak_tflops * 1e12
    layer_weights, head_weights, kv_per_token = model_numbers(args.model)
    weight_bytes = 2 * (layer_weights + head_weights)

    totals = {"all": [0.0, 0.0, 0.0, 0], "prefill/mixed": [0.0, 0.0, 0.0, 0], "decode": [0.0, 0.0, 0.0, 0]}
    for values in trace["steps"]:
        step = dict(zip(fields, values))
        if not step["seqs"]:
            continue
        tokens = step["prefill_tokens"] + step["decode_seqs"]
        flops = 2 * layer_weights * tokens + 2 * head_weights * step["seqs"]
        kv = step["context_sum"] * kv_per_token / bandwidth
        memory = weight_bytes / bandwidth + kv
        compute_aware = max(weight_bytes / bandwidth, flops / peak) + kv
        kind = "prefill/mixed" if step["prefill_tokens"] else "decode"
        for key in ("all", kind):
            totals[key][0] += step["wall_ms"] / 1e3
            totals[key][1] += memory
            totals[key][2] += compute_aware
            totals[key][3] += 1
    tokens_out = run["output_tokens"]
    print(f"{args.trace}: {run['model']}, {tokens_out:,} output tokens in {run['seconds']:.2f} s "
          f"({run['output_tok_per_s']:,.0f} tok/s); copy {bandwidth / 1e12:.2f} TB/s, matmul {args.peak_tflops:.0f} TFLOP/s")
    print(f"{'steps':>14} {'count':>6} {'measured s':>11} {'memory floor s':>15} {'compute-aware s':>16} "
          f"{'x memory':>9} {'x compute-aware':>16}")
    for key, (measured, memory, compute_aware, count) in totals.items():
        print(f"{key:>14} {count:>6} {measured:>11.2f} {memory:>15.2f} {compute_aware:>16.2f} "
              f"{measured / memory:>9.2f} {measured / compute_aware:>16.2f}")
    _, memory, compute_aware, _ = totals["all"]
    print(f"ceilings of the workload: memory {tokens_out / memory:,.0f} out tok/s, "
          f"compute-aware {tokens_out / compute_aware:,.0f} out tok/s")


if __name__ == "__main__":
    main()
