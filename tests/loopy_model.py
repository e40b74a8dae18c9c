"""A tiny model for speculative decoding tests: a saved tiny model with its attention and MLP outputs scaled down, so
its greedy text soon repeats itself (drafts get accepted) while each token still depends on the K/V of all before it
(a stale K/V after a rejected draft moves the log-probabilities far past the tests' bounds)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def loopy_model(source: str, out: Path, scale: float = 0.02) -> str:
    """``source`` (a tiny model directory) with o_proj and down_proj times ``scale``, saved at ``out``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    shutil.copytree(source, out)  # the tokenizer's files too
    model.save_pretrained(out)
    return str(out)
