"""vLLM's prompt dicts (``vllm.inputs.TextPrompt`` / ``TokensPrompt``), which ``LLM.generate`` takes as prompts."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
