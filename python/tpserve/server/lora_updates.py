"""vLLM's runtime LoRA adapter loading: ``POST /v1/load_lora_adapter`` ({"lora_name", "lora_path"}) and
``POST /v1/unload_lora_adapter`` ({"lora_name"}), answered with vLLM's plain-text success lines and its checks
(vLLM's entrypoints/openai/serving_models.py), served only where VLLM_ALLOW_RUNTIME_LORA_UPDATING is true or
--allow-runtime-lora-updating is given.

A load reaches every rank of every replica (``LoadLoRA``), each reading its shard into host memory at the same
point of its schedule (requests take turns in the --max-loras slots: ``engine/lora_slots.py``); it is served
(``/v1/models``, requests naming it) once every replica has it. An unload stops new requests naming the adapter at
once; requests that named it finish with it, as vLLM lets them, and its slot is free once they are gone. A beam
search sends a backend request per step, naming the adapter each time: it pins the adapter
(``ServedAdapters.pinned``), and an unload waits for its pins before the ranks drop it, so the search ends with the
adapter it started with (and a load of the name waits too)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from tpserve.launch.args import RUNTIME_LORA_ENV
from tpserve.message import LoadLoRA, LoRAAnswer, UnloadLoRA
from tpserve.models.adapters import read_adapter_config
from tpserve.server.client import FrontendClient
from tpserve.server.errors import APIError
from tpserve.server.protocol import _Body

logger = logging.getLogger(__name__)

UPDATE_TIMEOUT_S = 300.0  # a load reads the adapter on every rank; a rank that never answers is a 503, not a hang
PIN_POLL_S = 0.05  # how often an unload looks whether the searches pinning its adapter are done


class ServedAdapters:
    """The LoRA adapters requests may name (name -> directory, in load order): --lora-modules', then those loaded
    at run time."""

    def __init__(self, modules: Iterable[tuple[str, str]] = ()) -> None:
        self._paths = dict(modules)
        self._pins: dict[str, int] = {}  # name -> the calls using it across several backend requests

    def __contains__(self, name: object) -> bool:
        return name in self._paths

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._paths))

    def __len__(self) -> int:
        return len(self._paths)

    def path(self, name: str) -> str | None:
        return self._paths.get(name)

    def add(self, name: str, path: str) -> None:
        self._paths[name] = path

    def remove(self, name: str) -> str:
        """Forget ``name``; returns its directory."""
        return self._paths.pop(name)

    @contextlib.contextmanager
    def pinned(self, name: str) -> Iterator[None]:
        """Keep adapter ``name`` on the ranks while a call that sends several backend requests naming it (a beam
        search's steps) runs: its unload waits (``unpinned``). An adapter no longer served is the model's 404."""
        if name not in self._paths:
            raise APIError.model_not_found(name)
        self._pins[name] = self._pins.get(name, 0) + 1
        try:
            yield
        finally:
            self._pins[name] -= 1
            if not self._pins[name]:
                del self._pins[name]

    async def unpinned(self, name: str) -> None:
        """Return once no call pins ``name``."""
        while name in self._pins:
            await asyncio.sleep(PIN_POLL_S)


class LoadLoRAAdapterRequest(_Body):
    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str = ""


@dataclass
class LoRAUpdates:
    """The two routes' work, one update at a time (an update's checks and its engine answer stay together)."""

    adapters: ServedAdapters
    model_names: tuple[str, ...]  # the served model's names: no adapter may take one
    max_rank: int  # --max-lora-rank
    replicas: int  # --dp-size: each answers
    enabled: bool
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def load(self, frontend: FrontendClient, body: LoadLoRAAdapterRequest) -> str:
        self._check_enabled()
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            raise APIError.invalid("Both 'lora_name' and 'lora_path' must be provided.",
                                   "lora_path" if name else "lora_name")
        async with self.lock:
            if name in self.adapters:
                raise APIError.invalid(f"The lora adapter '{name}' has already been loaded.", "lora_name")
            if name in self.model_names:
                raise APIError.invalid(f"'{name}' is the served model's name (a request naming it would run the "
                                       "adapter, the model unreachable); give the adapter another name", "lora_name")
            if not os.path.isdir(path):  # vLLM's LoRAAdapterNotFoundError, a 404
                raise APIError(404, f"Loading lora {name} failed: No adapter found for {path}", param="lora_path",
                               code="not_found")
            try:  # most problems answered here, before any rank is bothered
                await asyncio.to_thread(read_adapter_config, path, self.max_rank)
            except (ValueError, OSError) as e:
                raise APIError.invalid(str(e), "lora_path") from None
            errors = [answer.error for answer in await self._ask(frontend, LoadLoRA(frontend.new_rid(), name, path))
                      if answer.error is not None]
            if errors:
                if len(errors) < self.replicas:  # undo the replicas that loaded it
                    await self._ask(frontend, UnloadLoRA(frontend.new_rid(), name))
                raise APIError.invalid(errors[0], "lora_path")
            self.adapters.add(name, path)
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, frontend: FrontendClient, body: UnloadLoRAAdapterRequest) -> str:
        self._check_enabled()
        name = body.lora_name
        if not name:
            raise APIError.invalid("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
        async with self.lock:
            if name not in self.adapters:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                               code="not_found")
            path = self.adapters.remove(name)  # new requests naming it: the unknown model's 404 from now on
            try:
                await self.adapters.unpinned(name)  # a beam search that started with it ends with it
                answers = await self._ask(frontend, UnloadLoRA(frontend.new_rid(), name))
            except APIError:  # the ranks may not have unloaded it: still served, so the unload can be tried again
                self.adapters.add(name, path)
                raise
            errors = [answer.error for answer in answers if answer.error is not None]
            if errors:  # no replica should lack an adapter the server serves
                logger.warning("unloading LoRA adapter '%s': %s", name, errors[0])
        logger.info("Removed LoRA adapter: name '%s'", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise APIError(404, f"Loading and unloading LoRA adapters at run time is disabled: set {RUNTIME_LORA_ENV}"
                           "=true or start the server with --allow-runtime-lora-updating", code="not_found")

    async def _ask(self, frontend: FrontendClient, update: LoadLoRA | UnloadLoRA) -> list[LoRAAnswer]:
        try:
            answers = await frontend.update_lora(update, self.replicas, UPDATE_TIMEOUT_S)
        except TimeoutError:
            raise APIError(503, f"the engine did not answer the LoRA update within {UPDATE_TIMEOUT_S:.0f} s",
                           type="server_error", code="timeout") from None
        if len(answers) < self.replicas or not all(isinstance(a, LoRAAnswer) for a in answers):
            raise APIError.stopping()
        return answers
