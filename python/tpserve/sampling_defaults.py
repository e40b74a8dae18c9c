"""Default sampling parameters from the model's ``generation_config.json`` (``--generation-config``, as vLLM's):
the temperature, top_p, top_k, min_p and repetition_penalty its authors recommend (Qwen3's: 0.6, 0.95, 20) apply
to every request that does not set them, on the server, in the shell and in the offline ``LLM``. Its
``max_new_tokens``, as vLLM's, is ``max_tokens``: the default of an offline call given no SamplingParams, and on the
server a cap on every request's (the least of it and the request's).

As vLLM, ``do_sample`` is not read (the values apply as written)."""

from __future__ import annotations

import os
from typing import Any

from tpserve.models.checkpoint import read_json_object
from tpserve.sampling_params import SamplingParams

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
CONFIG_FIELDS = (*SAMPLING_FIELDS, "max_new_tokens")  # what generation_config.json and the overrides may set
GENERATION_CONFIG_CHOICES = ("auto", "vllm")  # or a directory holding a generation_config.json


def load_sampling_defaults(
    model_dir: str, source: str = "auto", overrides: dict[str, Any] | None = None,
    names: tuple[str, str] = ("--generation-config", "--override-generation-config"),
) -> dict[str, Any]:
    """The SamplingParams fields a request gets where it sets none. ``source``: ``auto`` (``model_dir``'s
    generation_config.json, none if it has none), ``vllm`` (none: SamplingParams' own defaults), or a directory
    holding a generation_config.json. ``overrides`` take precedence. A bad value is a ValueError naming where it
    came from (``names``: the two settings as the user spells them)."""
    name, override_name = names
    if source == "vllm":
        config: dict[str, Any] = {}
    else:
        directory = model_dir if source == "auto" else os.path.expanduser(source)
        path = os.path.join(directory, "generation_config.json")
        if source != "auto" and not os.path.isfile(path):
            raise ValueError(f"{name} {source!r}: no generation_config.json there (auto: the model's, vllm: none)")
        config = read_json_object(path) if os.path.isfile(path) else {}
    unknown = sorted(set(overrides or {}) - set(CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"{override_name}: {unknown[0]!r} is not one of {', '.join(CONFIG_FIELDS)}")
    merged = {**config, **(overrides or {})}
    defaults = {field: merged[field] for field in CONFIG_FIELDS if merged.get(field) is not None}
    if "max_new_tokens" in defaults:  # transformers' name for max_tokens
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} {source!r}{f' with {override_name}' if overrides else ''}: {e}") from None
    return defaults


def describe(defaults: dict[str, Any]) -> str:
    return ", ".join(f"{field} {value}" for field, value in defaults.items()) or "none"
