"""The cluster decode kernel's settings and refusals (its math runs on Hopper only: tests/gpu/test_decode_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from tpserve.attention import cluster_decode
from tpserve.attention.cluster_decode import CLUSTER_ENV, splits_from_env, unsupported_reason


@pytest.mark.parametrize(("value", "splits"), [("0", 0), ("1", 1), ("16", 16)])
def test_splits_from_env(monkeypatch, value, splits):
    monkeypatch.setenv(CLUSTER_ENV, value)
    assert splits_from_env() == splits


def test_splits_default_off(monkeypatch):
    monkeypatch.delenv(CLUSTER_ENV, raising=False)
    assert splits_from_env() == 0


@pytest.mark.parametrize("value", ["17", "eight", "-1", ""])
def test_bad_splits_name_the_value(monkeypatch, value):
    monkeypatch.setenv(CLUSTER_ENV, value)
    with pytest.raises(ValueError, match=f"{CLUSTER_ENV}={value!r}"):
        splits_from_env()


def test_refusals_name_the_reason():
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert "bfloat16 pages" in unsupported_reason(128, 32, 8, True, bf16, cpu)
    assert "bfloat16 pages" in unsupported_reason(128, 32, 8, False, torch.float16, cpu)
    assert "head_dim 128, not 64" in unsupported_reason(64, 32, 8, False, bf16, cpu)
    assert "not 64:4" in unsupported_reason(128, 64, 4, False, bf16, cpu)
    assert "not 30:8" in unsupported_reason(128, 30, 8, False, bf16, cpu)
    assert "Hopper" in unsupported_reason(128, 32, 8, False, bf16, cpu)  # the layout passes: only the device is left
    assert cluster_decode.MAX_GROUP == 8
