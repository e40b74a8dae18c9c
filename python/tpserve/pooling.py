"""Embedding vectors from the scheduler's pooled hidden states (``TokenOutput.embedding``), for the server's
/v1/embeddings and ``LLM.embed``: last-token pooling, then optionally cut (Matryoshka) and L2-normalized."""

from __future__ import annotations

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
