"""Offline generation throughput on the anchors' workload (nano-vllm's bench.py).

256 requests; after ``random.seed(0)`` every prompt is drawn first (its length
``randint(100, 1024)``, then its token ids ``randint(0, 10000)``), then every output length
``randint(100, 1024)``; temperature 0.6, ``ignore_eos``. Random weights on a real config.json.

    python benchmarks/offline_throughput.py --model ../shared/models/configs/Qwen3-0.6B --out out/offline.json

With ``--trace`` every scheduler step is recorded (see step_trace.py): host time, time blocked on
the device, composition and, on CUDA, device time and idle gaps; the summary table is printed
last and the per-step records go into the JSON. The throughput of a traced run is flagged.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time

import torch
from common import copy_bandwidth, device_name, print_table, setup_logging, write_json
from step_trace import FloorModel, StepTracer, print_summary, summarize
from tpserve import LLM, SamplingParams


def workload(num: int, max_input: int, max_output: int) -> tuple[list[list[int]], list[SamplingParams]]:
    random.seed(0)
    # Lengths are drawn from [100, max]; a max under 100 (small CPU runs) draws from [max, max].
    min_input, min_output = min(100, max_input), min(100, max_output)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min_input, max_input))] for _ in range(num)]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(min_output, max_output))
        for _ in range(num)
    ]
    return prompts, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="directory with a config.json (weights are random)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (one process and GPU each)")
    parser.add_argument("--all-reduce", default="auto", help="TP all-reduce: auto | nccl | one_shot | two_shot")
    parser.add_argument("--mixed-prefill-tokens", type=int, default=0,
                        help="most prefill tokens a step with decodes carries (see --help of the server)")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=256, help="0 turns CUDA graphs off")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--decode-attention", default="auto", help="auto | flashinfer | xqa (the flashinfer backend's decode kernel)")
    parser.add_argument("--disable-overlap", action="store_true", help="ablation: no overlap scheduling")
    parser.add_argument("--hf-baseline", action="store_true",
                        help="instead run transformers' generate (static batches) on the same workload")
    parser.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of the baseline")
    parser.add_argument("--quantization", default=None, help="fp8: quantize the weights at load (issue 16)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or fp8_e4m3")
    parser.add_argument("--expert-parallel", action="store_true",
                        help="MoE: whole experts per rank instead of every expert cut (the server's --expert-parallel)")
    parser.add_argument("--dtype", default="bfloat16", help="engine dtype (float32 for quick CPU runs)")
    parser.add_argument("--trace", action="store_true",
                        help="record every scheduler step and print where the time goes (throughput flagged as traced)")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    setup_logging()

    prompts, params = workload(args.num_requests, args.max_input_len, args.max_output_len)
    if args.hf_baseline:
        return run_hf_baseline(args, prompts, params)
    bandwidth = None
    if args.trace and torch.cuda.is_available():  # for the decode floors; before the KV cache is sized
        bandwidth = copy_bandwidth()
        torch.cuda.empty_cache()
    start = time.perf_counter()
    llm = LLM(
        args.model,
        tp_size=args.tp_size,
        all_reduce=args.all_reduce,
        mixed_prefill_tokens=args.mixed_prefill_tokens,
        load_format="dummy",
        dtype=args.dtype,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        attention_backend=args.attention_backend,
        decode_attention=args.decode_attention,
        disable_overlap=args.disable_overlap,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        expert_parallel=args.expert_parallel,
    )
    startup = time.perf_counter() - start
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up

    tracer, floor = None, None
    if args.trace:
        engine = getattr(llm._driver, "engine", None)  # in-process at tp 1 (LocalRank)
        if engine is None:
            raise RuntimeError("--trace needs the engine in this process (tp 1)")
        tracer, floor = StepTracer(), FloorModel.from_engine(engine, bandwidth)
    with tracer or contextlib.nullcontext():
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    output_tokens = sum(len(o.token_ids) for o in outputs)
    expected = sum(p.max_tokens for p in params)
    if output_tokens != expected:
        raise RuntimeError(f"generated {output_tokens} tokens, the workload asks for {expected}")
    input_tokens = sum(len(p) for p in prompts)
    llm.close()

    row = {
        "requests": args.num_requests,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "seconds": seconds,
        "output_tok_per_s": output_tokens / seconds,
        "total_tok_per_s": (input_tokens + output_tokens) / seconds,
        "cuda_graph_max_bs": args.cuda_graph_max_bs,
        "overlap": not args.disable_overlap,
        "tp_size": args.tp_size,
        "all_reduce": args.all_reduce,
        "decode_attention": args.decode_attention,
        "startup_s": startup,
    }
    if args.dtype != "bfloat16":
        row["dtype"] = args.dtype
    if args.expert_parallel:
        row["expert_parallel"] = True
    if args.quantization or args.kv_cache_dtype != "auto":
        row["quantization"], row["kv_cache_dtype"] = args.quantization, args.kv_cache_dtype
    extra = {}
    if tracer is not None:
        row["traced"] = True
        summary = summarize(tracer, floor)
        extra["copy_bandwidth_Bps"] = bandwidth
        extra["trace"] = tracer.to_json(summary)
    traced = " (TRACED: the tracer adds host work to every step)" if tracer is not None else ""
    print(f"\nOffline throughput on {device_name()}; model {args.model}{traced}")
    print_table([row], list(row))
    if tracer is not None:
        bw = "n/a (no CUDA)" if bandwidth is None else f"{bandwidth / 1e12:.2f} TB/s"
        print_summary(extra["trace"]["summary"], f"Step trace (copy bandwidth {bw})")
    write_json(args.out, {"benchmark": "offline_throughput", "model": args.model, **row, **extra})


def run_hf_baseline(args: argparse.Namespace, prompts: list[list[int]], params: list[SamplingParams]) -> None:
    """transformers' generate on static batches (left-padded), sampling at temperature 0.6;
    each batch runs until its longest output is done, as static batching does."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    output_tokens, start = 0, time.perf_counter()
    for b in range(0, len(prompts), args.hf_batch_size):
        batch, batch_params = prompts[b : b + args.hf_batch_size], params[b : b + args.hf_batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
        new = max(p.max_tokens for p in batch_params)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.6, top_k=0, top_p=1.0,
                           max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        output_tokens += sum(p.max_tokens for p in batch_params)  # the tokens the workload asks for
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    row = {"requests": len(prompts), "output_tokens": output_tokens, "seconds": seconds,
           "output_tok_per_s": output_tokens / seconds, "hf_batch_size": args.hf_batch_size}
    print(f"\ntransformers generate baseline on {device_name()}; model {args.model}")
    print_table([row], list(row))
    write_json(args.out, {"benchmark": "offline_throughput_hf_baseline", "model": args.model, **row})


if __name__ == "__main__":
    main()
