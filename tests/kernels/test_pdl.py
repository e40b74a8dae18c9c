"""When tpserve's Triton kernels launch with programmatic dependent launch (``kernels/pdl.py``)."""

from __future__ import annotations

import torch

from tpserve.kernels import pdl


def test_triton_pdl_only_on_hopper_cuda_with_gdc_at_decode_sizes_and_not_switched_off(monkeypatch):
    monkeypatch.setattr(pdl, "pdl_supported", lambda index: True)
    monkeypatch.setattr(pdl, "triton_has_gdc", lambda: True)
    monkeypatch.delenv(pdl.TRITON_PDL_ENV, raising=False)
    cuda = torch.device("cuda", 0)
    assert pdl.triton_pdl(cuda, 1) and pdl.triton_pdl(cuda, pdl.PDL_MAX_ROWS)
    assert not pdl.triton_pdl(cuda, pdl.PDL_MAX_ROWS + 1)  # a prefill's launch: PDL cost it (session 30)
    assert not pdl.triton_pdl(torch.device("cpu"), 1)  # the interpreter has no grid dependency control
    monkeypatch.setenv(pdl.TRITON_PDL_ENV, "0")
    assert not pdl.triton_pdl(cuda, 1)
    monkeypatch.setenv(pdl.TRITON_PDL_ENV, "1")
    monkeypatch.setattr(pdl, "triton_has_gdc", lambda: False)  # a Triton older than 3.4
    assert not pdl.triton_pdl(cuda, 1)
    monkeypatch.setattr(pdl, "triton_has_gdc", lambda: True)
    monkeypatch.setattr(pdl, "pdl_supported", lambda index: False)  # before Hopper
    assert not pdl.triton_pdl(cuda, 1)
