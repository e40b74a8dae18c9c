"""Diagnostic: batch-1 decode logits of a tiny model, the add + RMSNorm fused into the GEMVs or not,
across CUDA graphs on/off, PDL on/off and GEMV variants (TPSERVE_GEMV_DEFINES); relative difference
to the separate-kernel eager run without PDL."""

from __future__ import annotations

import os
import sys
import tempfile

import torch

sys.path.insert(0, "tests")
from tpserve.config import EngineConfig  # noqa: E402
from tpserve.engine.engine import Engine  # noqa: E402
from tpserve.forward import SequenceInput  # noqa: E402
from tpserve.kvcache.pool import PageAllocator  # noqa: E402
from tpserve.tiny import make_tiny_model  # noqa: E402

TINY = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=512, seed=1)


def logits(model: str, quantization, graphs: bool, env: dict) -> torch.Tensor:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_total_tokens=1024,
                                     quantization=quantization, cuda_graph_max_bs=8 if graphs else 0))
        ids = list(range(40, 72))
        pages = PageAllocator(engine.num_pages).allocate(-(-len(ids) // engine.page_size))
        rows = [engine.forward([SequenceInput(ids[:8], 0, pages)])[0]]
        for pos in range(8, len(ids) - 1):
            rows.append(engine.forward([SequenceInput([ids[pos]], pos, pages)])[0])
        out = torch.stack(rows).float().cpu()
        del engine
        return out
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    model = make_tiny_model(tempfile.mkdtemp(), "qwen3", **TINY)
    for quantization in (None, "fp8"):
        base = logits(model, quantization, False, {"TPSERVE_GEMV_FUSE_NORM": "0", "TPSERVE_GEMV_PDL": "0"})
        for graphs in (False, True):
            for pdl in ("0", "1"):
                for fuse in ("0", "1"):
                    for defines in ("", "FUSED_L1=1"):
                        if fuse == "0" and defines:
                            continue
                        env = {"TPSERVE_GEMV_FUSE_NORM": fuse, "TPSERVE_GEMV_PDL": pdl, "TPSERVE_GEMV_DEFINES": defines}
                        got = logits(model, quantization, graphs, env)
                        rel = ((got - base).norm(dim=-1) / base.norm(dim=-1))
                        print(f"{quantization or 'bf16'} graphs={int(graphs)} pdl={pdl} fuse={fuse} {defines or 'L2':10s} "
                              f"rel mean {rel.mean():.2e} max {rel.max():.2e} worst step {int(rel.argmax())}", flush=True)


if __name__ == "__main__":
    main()
