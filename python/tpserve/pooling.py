"""Embedding vectors from the scheduler's pooled hidden states (``TokenOutput.embedding``), for the server's
/v1/embeddings and ``LLM.embed``: last-token pooling, then optionally cut (Matryoshka) and L2-normalized."""

from __future__ import annotations

import json
import os

import numpy as np

NORM_EPS = 1e-12  # torch.nn.functional.normalize's: a zero vector stays zero


def embedding_vector(raw: bytes, dimensions: int | None = None, normalize: bool = True) -> np.ndarray:
    """The vector of a pooled hidden state (little-endian float32 bytes): its first ``dimensions`` values (None:
    all), then scaled to length 1 where ``normalize``."""
    vector = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if dimensions is not None:
        if not 1 <= dimensions <= vector.size:
            raise ValueError(f"dimensions must be in [1, {vector.size}] (this model's hidden size), got {dimensions}")
        vector = vector[:dimensions]
    if normalize:
        vector = vector / max(float(np.linalg.norm(vector)), NORM_EPS)
    return vector


def unserved_pooling(model_dir: str) -> str | None:
    """Why this model's embeddings are not the last token's hidden state, or None: its sentence-transformers modules
    (``modules.json``) pool otherwise (``1_Pooling/config.json``'s mode) or transform the pooled vector (a Dense
    layer), which tpserve does not do. Without ``modules.json`` last-token pooling is taken, as vLLM takes it for
    decoder models."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    try:
        with open(modules_path, encoding="utf-8") as f:
            modules = json.load(f)
        for module in modules:
            kind, path = module.get("type", ""), module.get("path", "")
            if kind.endswith(".Dense"):
                return f"its sentence-transformers modules project the pooled vector ({path}: Dense); tpserve does not"
            if kind.endswith(".Pooling"):
                with open(os.path.join(model_dir, path, "config.json"), encoding="utf-8") as f:
                    modes = _pooling_modes(json.load(f))
                if modes != ["lasttoken"]:
                    shown = " + ".join(modes) or "none"
                    return (f"its sentence-transformers pooling is {shown} ({path}/config.json); tpserve pools "
                            "the last token only")
    except (OSError, ValueError, AttributeError, TypeError, RecursionError) as e:
        return f"its sentence-transformers modules.json could not be read ({type(e).__name__}: {e})"
    return None


def _pooling_modes(config: dict) -> list[str]:
    """The modes a sentence-transformers Pooling config turns on, as its class reads it: ``pooling_mode`` alone, else
    the ``pooling_mode_*`` flags over its defaults (mean tokens on)."""
    if isinstance(config.get("pooling_mode"), str):
        return [config["pooling_mode"]]  # "lasttoken", "mean", "cls", ...
    flags = {"mean_tokens": True} | {key.removeprefix("pooling_mode_"): on for key, on in config.items()
                                     if key.startswith("pooling_mode_")}
    return [mode for mode, on in flags.items() if on is True]
