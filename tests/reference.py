"""transformers as the reference implementation."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModel, AutoModelForCausalLM


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens, EOS included and not stopping at it (like ignore_eos), with HF's KV cache."""
    model = hf_model(model_dir)
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@torch.inference_mode()
def hf_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] logits of a full forward pass."""
    return hf_model(model_dir)(torch.tensor([ids])).logits[0].float()


@functools.lru_cache(maxsize=4)
def hf_base_model(model_dir: str):
    return AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_embedding(model_dir: str, ids: list[int], normalize: bool = True) -> torch.Tensor:
    """The last token's final hidden state (transformers' base model: after the final norm), L2-normalized."""
    hidden = hf_base_model(model_dir)(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(hidden, dim=0) if normalize else hidden


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; a non-finite ``actual`` fails the test."""
    assert torch.isfinite(actual).all(), "non-finite output"
    return float((actual.double() - expected.double()).norm() / expected.double().norm())
