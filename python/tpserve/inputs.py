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
    """vLLM's ``vllm.lora.request.LoRARequest``: which adapter a request runs with, named by ``lora_name``: one the
    LLM was started with (``lora_modules={name: path}``) or loaded (``add_lora``), or, with ``enable_lora=True``,
    the one at ``lora_path``, loaded the first time a request names it."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
