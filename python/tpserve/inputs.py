"""vLLM's prompt dicts (``vllm.inputs.TextPrompt`` / ``TokensPrompt``), which ``LLM.generate`` takes as prompts, and
its ``LoRARequest``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's ``vllm.lora.request.LoRARequest``: which adapter a request runs with. tpserve serves the adapters it
    was started with (``LLM(..., lora_modules={name: path})``, ``--lora-modules``), named by ``lora_name``."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
