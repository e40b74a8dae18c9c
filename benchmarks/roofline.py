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

Mixture-of-experts models (Qwen3-MoE): a step reads the attention, dense-MLP and router weights and
only the experts its tokens are routed to: with n tokens each picking k of E experts, a layer
touches E * (1 - (1 - k/E)^n) experts in expectation under uniform routing (random weights route
about uniformly; trained routers are less even, so touch fewer and this floor is conservative
there). The FLOPs are the active ones: k experts per token.

    python benchmarks/roofline.py docs/results/.../offline_qwen3_14b_traced.json \
        --model .models/Qwen3-14B --peak-tflops 766
    python benchmarks/roofline.py --model .models/Qwen3-30B-A3B --decode-batch 1 64 --context 1024 \
        --peak-tflops 766 --bandwidth-tbps 4.0     # the floors of single decode steps, no trace
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from common import expected_touched_experts
from tpserve.config import ModelConfig


@dataclass(frozen=True)
class ModelNumbers:
    """Weight counts of a bf16 model (2 bytes each)."""

    shared_weights: int  # read by every step: attention, dense MLPs, routers
    expert_weights: int  # one expert of one sparse layer (gate, up, down)
    moe_layers: int
    num_experts: int
    top_k: int
    head_weights: int
    kv_per_token: int  # bytes

    def touched_experts(self, tokens: int) -> float:
        """Expected distinct experts a layer reads for ``tokens`` tokens (uniform routing)."""
        if not self.moe_layers:
            return 0.0
        return expected_touched_experts(self.num_experts, self.top_k, tokens)

    def step_weight_bytes(self, tokens: int, seqs: int) -> float:
        experts = self.moe_layers * self.touched_experts(tokens) * self.expert_weights
        return 2 * (self.shared_weights + experts + (self.head_weights if seqs else 0))

    def step_flops(self, tokens: int, seqs: int) -> float:
        active = self.shared_weights + self.moe_layers * self.top_k * self.expert_weights
        return 2 * active * tokens + 2 * self.head_weights * seqs


def model_numbers(model_dir: str) -> ModelNumbers:
    cfg = ModelConfig.from_pretrained(model_dir)
    hidden, heads, kv_heads, head_dim = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    dense_mlp = 3 * hidden * cfg.intermediate_size
    moe = cfg.moe
    moe_layers = len(moe.layers) if moe else 0
    shared = cfg.num_hidden_layers * attention + len(cfg.dense_layers) * dense_mlp
    if moe:
        shared += moe_layers * moe.num_experts * hidden  # the routers
        if moe.shared_intermediate_size:  # Qwen2-MoE's shared expert (read by every step) and its gate
            shared += moe_layers * (3 * hidden * moe.shared_intermediate_size + hidden)
    return ModelNumbers(
        shared_weights=shared,
        expert_weights=3 * hidden * moe.intermediate_size if moe else 0,
        moe_layers=moe_layers,
        num_experts=moe.num_experts if moe else 0,
        top_k=moe.top_k if moe else 0,
        head_weights=cfg.vocab_size * hidden,
        kv_per_token=2 * cfg.num_hidden_layers * kv_heads * head_dim * 2,
    )


def step_floors(numbers: ModelNumbers, tokens: int, seqs: int, context_sum: int, bandwidth: float, peak: float
                ) -> tuple[float, float]:
    """(memory floor, compute-aware floor) in seconds of one step."""
    weights = numbers.step_weight_bytes(tokens, seqs) / bandwidth
    kv = context_sum * numbers.kv_per_token / bandwidth
    return weights + kv, max(weights, numbers.step_flops(tokens, seqs) / peak) + kv


def print_decode_floors(numbers: ModelNumbers, batches: list[int], context: int, bandwidth: float, peak: float) -> None:
    print(f"{'decode batch':>12} {'experts/layer':>14} {'weights GB':>11} {'GFLOP':>9} {'memory us':>10} {'compute-aware us':>17}")
    for batch in batches:
        memory, compute_aware = step_floors(numbers, batch, batch, batch * context, bandwidth, peak)
        print(f"{batch:>12} {numbers.touched_experts(batch):>14.1f} {numbers.step_weight_bytes(batch, batch) / 1e9:>11.2f} "
              f"{numbers.step_flops(batch, batch) / 1e9:>9.1f} {memory * 1e6:>10.0f} {compute_aware * 1e6:>17.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", nargs="?", help="JSON written by offline_throughput.py --trace")
    parser.add_argument("--model", required=True, help="the run's model directory (config.json)")
    parser.add_argument("--peak-tflops", type=float, required=True, help="bf16 matmul peak measured on the machine")
    parser.add_argument("--bandwidth-tbps", type=float, default=None,
                        help="copy bandwidth (default: the one the trace measured)")
    parser.add_argument("--decode-batch", type=int, nargs="+", default=None,
                        help="print the floors of one decode step at these batch sizes (needs --bandwidth-tbps)")
    parser.add_argument("--context", type=int, default=1024, help="tokens of context per sequence for --decode-batch")
    args = parser.parse_args()
    numbers = model_numbers(args.model)
    if args.decode_batch:
        if not args.bandwidth_tbps:
            parser.error("--decode-batch needs --bandwidth-tbps")
        print_decode_floors(numbers, args.decode_batch, args.context, args.bandwidth_tbps * 1e12, args.peak_tflops * 1e12)
    if args.trace is None:
        if not args.decode_batch:
            parser.error("give a trace, --decode-batch, or both")
        return
    with open(args.trace) as f:
        run = json.load(f)
    trace = run["trace"]
    fields = trace["step_fields"]
    bandwidth = (args.bandwidth_tbps * 1e12) if args.bandwidth_tbps else run["copy_bandwidth_Bps"]
    peak = args.peak_tflops * 1e12

    totals = {"all": [0.0, 0.0, 0.0, 0], "prefill/mixed": [0.0, 0.0, 0.0, 0], "decode": [0.0, 0.0, 0.0, 0]}
    for values in trace["steps"]:
        step = dict(zip(fields, values))
        if not step["seqs"]:
            continue
        tokens = step["prefill_tokens"] + step["decode_seqs"]
        memory, compute_aware = step_floors(numbers, tokens, step["seqs"], step["context_sum"], bandwidth, peak)
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
