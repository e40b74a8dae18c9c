"""Offline generation throughput on the anchors' workload (nano-vllm's bench.py).

256 requests; after ``random.seed(0)`` every prompt is drawn first (its length
``randint(100, 1024)``, then its token ids ``randint(0, 10000)``), then every output length
``randint(100, 1024)``; temperature 0.6, ``ignore_eos``. Random weights on a real config.json.

    python benchmarks/offline_throughput.py --model ../shared/models/configs/Qwen3-0.6B --out out/offline.json
"""

from __future__ import annotations

import argparse
import random
import time

from common import device_name, print_table, setup_logging, write_json
from tpserve import LLM, SamplingParams


def workload(num: int, max_input: int, max_output: int) -> tuple[list[list[int]], list[SamplingParams]]:
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input))] for _ in range(num)]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(100, max_output))
        for _ in range(num)
    ]
    return prompts, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="directory with a config.json (weights are random)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--cuda-graph-max-bs", type=int, default=256, help="0 turns CUDA graphs off")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--disable-overlap", action="store_true", help="ablation: no overlap scheduling")
    parser.add_argument("--hf-baseline", action="store_true",
                        help="instead run transformers' generate (static batches) on the same workload")
    parser.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of the baseline")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    setup_logging()

    prompts, params = workload(args.num_requests, args.max_input_len, args.max_output_len)
    if args.hf_baseline:
        return run_hf_baseline(args, prompts, params)
    start = time.perf_counter()
    llm = LLM(
        args.model,
        load_format="dummy",
        dtype="bfloat16",
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        attention_backend=args.attention_backend,
        disable_overlap=args.disable_overlap,
    )
    startup = time.perf_counter() - start
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up

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
        "startup_s": startup,
    }
    print(f"\nOffline throughput on {device_name()}; model {args.model}")
    print_table([row], list(row))
    write_json(args.out, {"benchmark": "offline_throughput", "model": args.model, **row})


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
