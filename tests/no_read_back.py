"""``NoReadBack``: a torch function mode that fails a test on any call that reads a device tensor back to the host.

On CUDA such a read (``.item()``, ``.tolist()``, a tensor's truth value, a Python scalar set into a tensor, ops
whose output size depends on the data) is a stream sync: the host waits for the GPU to drain, and a step's
launches stop running ahead of it (overlap scheduling, a prefill's layers). The CPU cannot see a sync, so tests
watch the torch calls of code that runs on the GPU instead."""

from __future__ import annotations

import numbers

from torch.overrides import TorchFunctionMode


class NoReadBack(TorchFunctionMode):
    """Raises on any torch call that would wait for a CUDA stream."""

    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
             "repeat_interleave", "unique", "bincount", "masked_select"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            raise AssertionError(f"{name} reads a device tensor back to the host")
        if name == "__setitem__" and isinstance(args[2], numbers.Number):
            raise AssertionError("a Python scalar set into a tensor is a host-to-device copy and a sync on CUDA")
        return func(*args, **(kwargs or {}))
