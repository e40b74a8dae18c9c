"""Resolving ``--model``: a local directory, or a Hugging Face id already in the local cache."""

from __future__ import annotations

import os


class ModelNotFound(Exception):
    pass


def resolve_model_dir(model: str) -> str:
    """The local directory holding ``model``'s files. tpserve never downloads anything."""
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        return os.path.abspath(expanded)
    if os.path.exists(expanded):
        raise ModelNotFound(f"model path {model!r} is not a directory")
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelNotFound(
            f"model {model!r} is not a local directory (nor a Hugging Face id like 'org/name')"
        )
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(model, local_files_only=True)
    except Exception as e:  # LocalEntryNotFoundError, or an invalid repo id
        raise ModelNotFound(
            f"model {model!r} is not a local directory and is not in the local Hugging Face "
            f"cache ({constants.HF_HUB_CACHE}); tpserve runs offline and never downloads. Download it "
            f"where there is internet (e.g. `hf download {model}`) into that cache, "
            f"or pass the model's local directory ({type(e).__name__})"
        ) from e
