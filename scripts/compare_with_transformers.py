"""Check tpserve against transformers on a model directory: greedy tokens and max logit error.

    python scripts/compare_with_transformers.py MODEL_DIR [--tp-size 2] [--tokens 32]

Runs in float32 on the CPU. With no MODEL_DIR it makes a tiny random Qwen3 first.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM

from tpserve import LLM, SamplingParams
from tpserve.engine_config import EngineConfig
from tpserve.forward import SequenceInput
from tpserve.engine.engine import Engine
from tpserve.kvcache.pool import PageAllocator

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41], list(range(100, 137))]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@torch.inference_mode()
def max_logit_error(model_dir: str, hf_model, ids: list[int]) -> float:
    """Prefill half of ``ids`` then decode the rest token by token through the paged cache."""
    engine = Engine(EngineConfig(model=model_dir, device="cpu", dtype="float32"))
    pages = PageAllocator(engine.num_pages).allocate(-(-len(ids) // engine.page_size))
    half = len(ids) // 2
    rows = [engine.forward([SequenceInput(ids[:half], 0, pages)])[0]]
    rows += [engine.forward([SequenceInput([ids[p]], p, pages)])[0] for p in range(half, len(ids) - 1)]
    ref = hf_model(torch.tensor([ids])).logits[0, half - 1 : len(ids) - 1].float()
    return (torch.stack(rows) - ref).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="Hugging Face model directory (default: a tiny random Qwen3)")
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks for tpserve (CPU processes)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens to generate per prompt")
    args = parser.parse_args()
    model_dir = args.model
    if model_dir is None:
        from tpserve.tiny import make_tiny_model

        model_dir = make_tiny_model(tempfile.mkdtemp(prefix="tpserve-compare-"), "qwen3")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    err = max_logit_error(model_dir, hf, list(range(3, 67)))
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    with LLM(model_dir, tp_size=args.tp_size, device="cpu", dtype="float32") as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    same = [o.token_ids == hf_greedy(hf, p, args.tokens) for p, o in zip(PROMPTS, outs)]
    print(f"model {model_dir}, tp {args.tp_size}")
    print(f"max logit error (tp 1, prefill + paged decode): {err:.2e}")
    print(f"greedy tokens equal to transformers: {sum(same)}/{len(same)} prompts x {args.tokens} tokens")


if __name__ == "__main__":
    main()
