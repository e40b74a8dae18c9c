"""How closely a tiny model served one way (FP8 weights, an FP8 KV cache) follows the same model
served plainly on the CPU: teacher-forced logits and argmaxes, and free-running greedy tokens."""

from __future__ import annotations

from typing import Any

from test_vs_transformers import teacher_forced_logits
from tpserve import LLM, SamplingParams
from tpserve.engine_config import EngineConfig
from tpserve.engine.engine import Engine


def agreement(model_dir: str, variant: dict[str, Any]) -> dict[str, float]:
    """``err``: the largest logit difference over the largest logit; ``same_argmax``: the share of
    teacher-forced steps with the same argmax; ``equal``/``first``: the share of greedy tokens /
    first tokens equal over 11 short prompts."""
    ids = list(range(30, 70))
    plain, other = (
        teacher_forced_logits(Engine(EngineConfig(model=model_dir, device="cpu", page_size=4, max_total_tokens=256, **kw)), ids, prefill=9)
        for kw in ({}, variant)
    )
    prompts = [[i, i + 1, i + 2, i + 5] for i in range(20, 300, 28)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = []
    for kw in ({}, variant):
        with LLM(model_dir, device="cpu", **kw) as llm:
            outs.append([o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)])
    pairs = [(a, b) for x, y in zip(*outs) for a, b in zip(x, y)]
    return {
        "err": (other - plain).abs().max().item() / plain.abs().max().item(),
        "same_argmax": (other.argmax(-1) == plain.argmax(-1)).float().mean().item(),
        "equal": sum(a == b for a, b in pairs) / len(pairs),
        "first": sum(x[0] == y[0] for x, y in zip(*outs)) / len(prompts),
    }


def describe(a: dict[str, float]) -> str:
    return (f"logit error {a['err']:.1%} of the largest logit; teacher-forced argmax equal {a['same_argmax']:.0%}; "
            f"greedy tokens equal {a['equal']:.0%} (first token {a['first']:.0%})")
