"""transformers as the reference implementation."""

from __future__ import annotations

import functools
import json
import os
import shutil

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **attention_of(model_dir)).eval()


def attention_of(model_dir: str) -> dict[str, str]:
    """transformers' eager attention for a model whose config soft-caps the attention scores (Gemma 2): its SDPA path
    has no soft-cap and refuses one. Gemma 2 declares no SDPA support and loads eager anyway; named here so that the
    reference cannot lose the cap to a change of transformers' default."""
    with open(os.path.join(model_dir, "config.json")) as f:
        capped = json.load(f).get("attn_logit_softcapping") is not None
    return {"attn_implementation": "eager"} if capped else {}


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
def hf_beam_search(model_dir: str, prompt: list[int], beams: int, max_new_tokens: int) -> list[tuple[list[int], float]]:
    """transformers' beam search, every beam running ``max_new_tokens`` (length_penalty 0: ranked by their summed
    log-probabilities): (generated tokens, that sum) of each beam, best first."""
    out = hf_model(model_dir).generate(
        torch.tensor([prompt]), num_beams=beams, num_return_sequences=beams, max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens, do_sample=False, length_penalty=0.0, early_stopping=False,
        output_scores=True, return_dict_in_generate=True)
    return [(seq[len(prompt):].tolist(), float(score)) for seq, score in zip(out.sequences, out.sequences_scores)]


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


@functools.lru_cache(maxsize=4)
def hf_classifier(model_dir: str):
    return AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_class_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    """A sequence classifier's class logits for one prompt (its score head at the last token)."""
    return hf_classifier(model_dir)(torch.tensor([ids])).logits[0].float()


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; a non-finite ``actual`` fails the test."""
    assert torch.isfinite(actual).all(), "non-finite output"
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def save_classifier(model_dir: str, out, labels: list[str]) -> str:
    """The tiny model's decoder under a random score head, saved as transformers saves a classifier (its head's
    std is raised from transformers' 0.02, whose logits would be nearly equal)."""
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32, id2label=dict(enumerate(labels)), label2id={l: i for i, l in enumerate(labels)})
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(labels)))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{model_dir}/{name}", out)
    return str(out)

