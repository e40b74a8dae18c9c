"""LoRA adapters for tests, made and saved by PEFT (as users' adapters are), with random A and B (PEFT starts B at
zero), and PEFT's model as the reference."""

from __future__ import annotations

import functools

import torch


def make_adapter(model_dir: str, out_dir: str, targets: tuple[str, ...] | str, rank: int = 4, alpha: int = 8,
                 seed: int = 0, rslora: bool = False, dtype: torch.dtype | None = None) -> str:
    """``targets``: module names, or a string PEFT takes (a regex, "all-linear"); ``dtype``: the saved tensors'."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha,
                                                 target_modules=targets if isinstance(targets, str) else list(targets),
                                                 use_rslora=rslora))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2)
    if dtype is not None:
        peft_model.to(dtype)
    peft_model.save_pretrained(out_dir)
    return out_dir


@functools.lru_cache(maxsize=4)
def peft_model(model_dir: str, adapter_dir: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


@torch.inference_mode()
def peft_greedy(model_dir: str, adapter_dir: str, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """PEFT's greedy tokens (EOS not stopping them) and the logits [max_new_tokens, vocab] they were picked from."""
    model = peft_model(model_dir, adapter_dir)
    ids, rows = list(prompt), []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        rows.append(logits)
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], torch.stack(rows)
