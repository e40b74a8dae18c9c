"""A checkpoint's safetensors files: which ones (the index's, ``model.safetensors``, or every
``*.safetensors``) and whether each can be read, so that a partial download is an error naming
the file before any rank starts loading it."""

from __future__ import annotations

import json
import os
from typing import Any

from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files, in load order; a file the index names but the directory lacks is an error."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index):
        names = _index_files(index)
        missing = [name for name in names if not os.path.isfile(os.path.join(model_dir, name))]
        if missing:
            raise FileNotFoundError(
                f"{INDEX_FILE} names {', '.join(missing)}, which is not in {model_dir} (an incomplete download?)"
            )
        return [os.path.join(model_dir, name) for name in names]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir} (use load_format='dummy' for random weights)")
    return [os.path.join(model_dir, n) for n in found]


def tensor_names(model_dir: str) -> set[str] | None:
    """The checkpoint's tensor names (the index's, else the files' headers), or None where it has no weights."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index):
        weight_map = read_json_object(index).get("weight_map")
        return set(weight_map) if isinstance(weight_map, dict) else None
    try:
        files = safetensors_files(model_dir)
    except FileNotFoundError:
        return None
    names: set[str] = set()
    for path in files:
        names.update(open_safetensors(path).keys())
    return names


def read_json_object(path: str) -> dict[str, Any]:
    """A JSON file holding an object (config.json, the index); anything else is a ValueError naming the file."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(data).__name__}")
    return data


def _index_files(index: str) -> list[str]:
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index} has no weight_map (an object of tensor name -> file name)")
    return sorted(set(weight_map.values()))


def open_safetensors(path: str) -> Any:
    """``safe_open(path)``; a file that is truncated or not safetensors is an error naming it."""
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e}); download it again") from None


def check_safetensors(model_dir: str) -> None:
    """Read every weight file's header (not its tensors): what the loader would fail on later."""
    for path in safetensors_files(model_dir):
        open_safetensors(path)
