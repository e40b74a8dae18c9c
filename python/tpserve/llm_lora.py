"""The offline ``LLM``'s LoRA methods (vLLM's ``add_lora``, ``remove_lora``, ``list_loras``, and a ``LoRARequest``
with a path loaded on first use): each load or unload is a message every replica's ranks apply at the same point of
their schedule, as the server's /v1/load_lora_adapter sends it."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from tpserve.inputs import LoRARequest
from tpserve.message import LoadLoRA, UnloadLoRA
from tpserve.models.adapters import read_adapter_config

if TYPE_CHECKING:
    from tpserve.engine_config import EngineConfig


class LoRAMethods:
    """Mixed into ``LLM``, whose ``config``, ``_ask`` and ``_take_rid`` they use."""

    config: EngineConfig
    _adapters: dict[str, str]  # loaded adapters' names -> paths
    _lora_updates: threading.RLock  # one update at a time: a name's check and its load or unload stay together

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load the PEFT adapter at ``lora_request.lora_path`` as ``lora_request.lora_name`` (with
        ``enable_lora=True``; its requests take turns in the ``max_loras`` slots), as vLLM's
        ``LLM.llm_engine.add_lora``; later calls may name it. A ValueError says why it cannot be loaded."""
        if not isinstance(lora_request, LoRARequest) or not lora_request.lora_name or not lora_request.lora_path:
            raise ValueError(f"add_lora needs a LoRARequest with a lora_name and a lora_path, got {lora_request!r}")
        name, path = lora_request.lora_name, os.fspath(lora_request.lora_path)
        with self._lora_updates:
            if name in self._adapters:
                raise ValueError(f"LoRA adapter {name!r} is already loaded")
            read_adapter_config(path, self.config.max_lora_rank)  # most problems named before the ranks see it
            self._update_lora(LoadLoRA(self._take_rid(), name, path), name)
            self._adapters[name] = path
        return True

    def remove_lora(self, lora_name: str) -> bool:
        """Unload an adapter (``add_lora``'s or ``lora_modules``'); False where none is loaded by that name."""
        with self._lora_updates:
            if lora_name not in self._adapters:
                return False
            del self._adapters[lora_name]
            self._update_lora(UnloadLoRA(self._take_rid(), lora_name), lora_name)
        return True

    def list_loras(self) -> list[str]:
        """The loaded LoRA adapters' names."""
        return list(self._adapters)

    def _update_lora(self, msg: LoadLoRA | UnloadLoRA, name: str) -> None:
        replies = self._ask(msg, msg.__struct_config__.tag)
        errors = [reply.lora.error for reply in replies if reply.lora is not None and reply.lora.error is not None]
        if errors and isinstance(msg, LoadLoRA) and len(errors) < len(replies):  # undo the replicas that loaded it
            self._ask(UnloadLoRA(self._take_rid(), name), "unload_lora")
        if errors:
            raise ValueError(errors[0])

    def _lora_name(self, request: LoRARequest) -> str:
        """The adapter a request names; one with a lora_path is loaded on first use where the LLM has adapter slots
        (enable_lora), as vLLM's LLM loads a LoRARequest's adapter."""
        loaded = self._adapters
        if (isinstance(request, LoRARequest) and request.lora_name and request.lora_path
                and request.lora_name not in loaded and self.config.enable_lora):
            with self._lora_updates:  # threads naming a new adapter at once (or add_lora meanwhile) load it once
                if request.lora_name not in loaded:
                    self.add_lora(request)
        if not isinstance(request, LoRARequest) or request.lora_name not in loaded:
            name = getattr(request, "lora_name", request)
            raise ValueError(f"LoRA adapter {name!r} is not loaded: start the LLM with lora_modules={{name: path}} "
                             f"or load it with add_lora (loaded: {', '.join(loaded) or 'none'})")
        return request.lora_name
