"""A step's copies between host and GPU on streams of their own, off the compute stream.

Between two pipelined batch-1 decode graphs the compute stream ran the sampler, the samples' download,
three uploads of the next step's inputs and the placeholder gather: seven operations in ~40 us, of which
~15 us busy, the rest the switches between kernels and the copy engine (docs/benchmarks.md, session 16).
Here the samples are downloaded once the sampler is done, while the next graph runs, and a decode graph's
inputs are uploaded, in one copy, while the previous graph runs, into one of two device buffers; one kernel
(``kernels/graph_inputs.py``) then installs them. The compute stream runs the sampler and that kernel only.
Uploads and downloads take separate streams: a step's upload must not queue behind the download of the
step before, which waits for that step's graph. Measured (H200, Qwen3-8B batch 1, session 23): ~13 us between
graphs, against the same copies on the compute stream 0.995x the FP8 step and 0.998x the bf16 one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class _Slot:
    """One of two upload buffers: pinned on the host, and on the device."""

    host: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int32))
    device: torch.Tensor | None = None
    uploaded: torch.cuda.Event = field(default_factory=torch.cuda.Event)  # the copy into ``device`` is done
    consumed: torch.cuda.Event = field(default_factory=torch.cuda.Event)  # the compute stream's last read


class SideCopies:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.upload_stream = torch.cuda.Stream(device)
        self.download_stream = torch.cuda.Stream(device)
        self._slots = (_Slot(), _Slot())
        self._next = 0

    def reserve(self, words: int) -> None:
        """Make both upload buffers ``words`` int32 long, now, before any step: a buffer replaced later
        could take memory the compute stream still uses (the allocator orders reuse on one stream only)."""
        for slot in self._slots:
            if slot.host.numel() < words:
                slot.host = torch.empty(words, dtype=torch.int32, pin_memory=True)
                slot.device = torch.empty(words, dtype=torch.int32, device=self.device)

    def upload(self, packed: np.ndarray) -> tuple[torch.Tensor, _Slot]:
        """``packed`` (int32, at most the ``reserve``d words) in a device buffer, copied on the upload
        stream. The compute stream must ``wait`` for the slot before reading it and ``release`` it after."""
        slot = self._slots[self._next]
        n = packed.size
        if slot.device is None or slot.host.numel() < n:
            raise ValueError(f"{n} words to upload, {slot.host.numel()} reserved")
        self._next ^= 1
        slot.uploaded.synchronize()  # the pinned buffer's last copy has run (two steps ago: long done)
        slot.host[:n].numpy()[:] = packed
        stream = self.upload_stream
        with torch.cuda.stream(stream):
            stream.wait_event(slot.consumed)  # the kernel that read this buffer two steps ago
            slot.device[:n].copy_(slot.host[:n], non_blocking=True)
            slot.uploaded.record(stream)
        return slot.device[:n], slot

    @staticmethod
    def wait(slot: _Slot) -> None:
        torch.cuda.current_stream().wait_event(slot.uploaded)

    @staticmethod
    def release(slot: _Slot) -> None:
        slot.consumed.record(torch.cuda.current_stream())

    def download(self, outputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
        """``outputs`` copied into pinned host tensors on the download stream once the compute stream's work
        so far (the sampler) is done; the event marks their arrival."""
        stream = self.download_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        host = {}
        with torch.cuda.stream(stream):
            for name, tensor in outputs.items():
                host[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host[name].copy_(tensor, non_blocking=True)
                tensor.record_stream(stream)  # made on the compute stream, read here
            done = torch.cuda.Event()
            done.record(stream)
        return host, done
