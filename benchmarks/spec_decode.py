"""Speculative decoding with n-gram drafts against plain decoding, offline, batch 1 and a few more.

The model is the config's with random weights whose attention and MLP outputs are scaled down (``--scale``, 0.02:
its greedy text soon repeats itself, as extraction and code editing repeat their context), so the drafts' acceptance
is high but not whole; the table gives it beside each speedup, so a figure is read with it. Both engines decode the
same prompts greedily (the same tokens: checked), one request at a time then ``batch`` at once; the time is the
wall time of ``LLM.generate`` over the generated tokens, the second of two runs. ``--scale 0`` makes each token a
function of the one before (attention and MLP add nothing; their weights are still read): the text cycles and every
draft is accepted once it does, so the table gives the speedup when drafts are right. At 0.02 on a bf16 8B config
near-ties part the drafted and plain texts (session 52: 0 / 2 of 36 / 281 drafts accepted).

    python benchmarks/spec_decode.py --config tests/data/configs/Qwen3-0.6B --tokens 256 --batch-sizes 1,8
    python benchmarks/spec_decode.py --config tests/data/configs/Qwen3-8B --scale 0 --vocab-size 4096 --batch-sizes 1,8

``--prompt-tokens N`` gives each request a prompt of N tokens (long contexts: a drafted step's rows each read the
sequence's KV cache in the decode graph), and ``--chunked`` adds an engine whose drafted steps run eagerly as
chunks (``cuda_graph_max_bs`` at the largest batch, so their rows fit no graph), which read it once a sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from common import device_name, print_table, setup_logging, write_json
from tpserve import LLM, SamplingParams


def loopy_model(config_dir: str, scale: float, out: str, vocab_size: int | None) -> str:
    """The config's model with random weights (bf16), o_proj and down_proj times ``scale`` (and ``vocab_size``
    tokens, where given), saved at ``out`` with the directory's other files (its tokenizer)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(config_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    config = AutoConfig.from_pretrained(os.path.abspath(config_dir))
    if vocab_size is not None:
        config.vocab_size = vocab_size
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    model.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a model directory's config.json (weights are made)")
    parser.add_argument("--scale", type=float, default=0.02)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="fewer tokens than the config's: a random model's text then repeats sooner")
    parser.add_argument("--tokens", type=int, default=256, help="generated tokens per request")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-tokens", type=int, default=3, help="each prompt's length (a long context)")
    parser.add_argument("--chunked", action="store_true", help="also drafts run eagerly as chunks (no graph rows)")
    parser.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, '
                        '"prompt_lookup_min": 1}')
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    setup_logging()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = loopy_model(args.config, args.scale, os.path.join(tmp, "model"), args.vocab_size)
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        results: dict[tuple[str, int], tuple[float, list[list[int]]]] = {}
        spec = json.loads(args.spec)
        engines = [("plain", {}), ("ngram", {"speculative_config": spec})]
        if args.chunked:
            engines.append(("ngram_chunked", {"speculative_config": spec, "cuda_graph_max_bs": max(batches)}))
        with open(os.path.join(model_dir, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        for name, kwargs in engines:
            with LLM(model_dir, **kwargs) as llm:
                for batch in batches:
                    prompts = [[(7 + 31 * i + j) % vocab for j in range(args.prompt_tokens)] for i in range(batch)]
                    # untimed first: the drafted steps' shapes compile their kernels here (Triton, FlashInfer plans)
                    llm.generate(prompts, params, use_tqdm=False)
                    before = llm.replica_stats()[0]
                    start = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    elapsed = time.perf_counter() - start
                    after = llm.replica_stats()[0]
                    drafts = after.draft_tokens_total - before.draft_tokens_total
                    accepted = after.accepted_tokens_total - before.accepted_tokens_total
                    results[(name, batch)] = (elapsed, [o.outputs[0].token_ids for o in outs])
                    rows.append({"engine": name, "batch": batch, "out_tok_s": round(batch * args.tokens / elapsed, 1),
                                 "drafts": drafts, "accepted": accepted,
                                 "acceptance": round(accepted / drafts, 3) if drafts else None})
        for name, _ in engines[1:]:
            for batch in batches:
                plain_s, plain_tokens = results[("plain", batch)]
                spec_s, spec_tokens = results[(name, batch)]
                same = sum(a == b for a, b in zip(plain_tokens, spec_tokens))
                rows.append({"engine": f"{name} / plain", "batch": batch, "out_tok_s": round(plain_s / spec_s, 3),
                             "drafts": f"same tokens {same}/{batch}", "accepted": "", "acceptance": ""})
    print(f"device: {device_name()}, config {args.config}, scale {args.scale}, vocab {args.vocab_size or 'the config'}'s, "
          f"{args.prompt_tokens}-token prompts, {args.tokens} tokens, spec {args.spec}")
    print_table(rows, ["engine", "batch", "out_tok_s", "drafts", "accepted", "acceptance"])
    write_json(args.out, {"device": device_name(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
