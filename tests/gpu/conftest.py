"""Fixtures of the GPU tests."""

from __future__ import annotations

import pytest

from tpserve.layers.linear import MergedColumnParallelLinear, ParallelLinear


@pytest.fixture
def no_silu(monkeypatch):
    """Fails on any SiLU-and-mul of a dense MLP (a GELU model's must never take one): the merged layer's (GEMV epilogue
    or FlashInfer), or a GEMV asked for its silu_mul epilogue. Returns the monkeypatch, whose undo() lifts the spies
    (for a SiLU model's baseline)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a GELU model took a SiLU path")

    gemv = ParallelLinear.gemv

    def checked_gemv(self, x, **fusion):
        assert not fusion.get("silu_mul"), "a GELU model took the GEMV's SiLU epilogue"
        return gemv(self, x, **fusion)

    monkeypatch.setattr(MergedColumnParallelLinear, "silu_and_mul", refuse)
    monkeypatch.setattr(ParallelLinear, "gemv", checked_gemv)
    return monkeypatch
