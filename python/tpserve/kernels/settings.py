"""Experiment settings of tpserve's kernels read from the environment (``TPSERVE_GEMV_DEFINES``,
``TPSERVE_TRITON_DECODE``). A leaf module: ``tpserve.engine_config`` reaches the attention kernels, which read these."""

from __future__ import annotations

# The small-batch MoE kernels' tiles (``kernels/moe_small.py``), read where a MoE layer is built (``layers/moe.py``,
# which must not import Triton on the CPU path).
MOE_SMALL_ENV = "TPSERVE_MOE_SMALL"


def int_settings(setting: str, env: str) -> tuple[tuple[str, int], ...]:
    """An experiment's ``NAME=INTEGER`` list (spaces or commas between), e.g. ``chunk=16 max_splits=64``
    -> (("chunk", 16), ("max_splits", 64)); ``env`` names the variable in the error."""
    items = setting.replace(",", " ").split()
    try:
        return tuple((name, int(value)) for name, value in (item.split("=") for item in items))
    except ValueError:
        raise ValueError(f"{env}={setting!r}: expected NAME=INTEGER[,NAME=INTEGER...]") from None
