"""Diagnostic: batch-1 decode logits of a tiny model (bf16 and FP8 weights, the add + RMSNorm fused
into the GEMVs or not) in CUDA graphs with PDL and its variants (GEMV builds by TPSERVE_GEMV_DEFINES,
Triton kernels without PDL, FlashInfer's add + RMSNorm; GEMV_VARIANTS: ';'-separated TPSERVE_GEMV_DEFINES), against the eager run without the GEMV's PDL:
PDL changes no arithmetic, so every run should be bit-equal to it. Another GEMM's difference gives
the scale of bf16 rounding."""

from __future__ import annotations

import os
import sys
import tempfile

import torch

sys.path.insert(0, "tests")
from tpserve.engine_config import EngineConfig  # noqa: E402
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
        # clones: a graph replay overwrites the logits of the one before
        rows = [engine.forward([SequenceInput(ids[:8], 0, pages)])[0].clone()]
        for pos in range(8, len(ids) - 1):
            rows.append(engine.forward([SequenceInput([ids[pos]], pos, pages)])[0].clone())
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
        name = quantization or "bf16"
        # the scale of a bf16 path's differences: another GEMM for the same products
        other = {"TPSERVE_FP8_GEMM": "triton"} if quantization else {"TPSERVE_BF16_GEMV": "0"}
        for fuse in ("0", "1"):
            base_env = {"TPSERVE_GEMV_FUSE_NORM": fuse, "TPSERVE_GEMV_PDL": "0"}
            base = logits(model, quantization, False, base_env)
            runs = [("eager other GEMM", False, other), ("graph no PDL", True, {}), ("graph PDL", True, {"TPSERVE_GEMV_PDL": "1"})]
            runs += [(f"graph PDL {d}", True, {"TPSERVE_GEMV_PDL": "1", "TPSERVE_GEMV_DEFINES": d})
                     for d in os.environ.get("GEMV_VARIANTS", "EARLY_TRIGGER=1").split(";") if d]
            runs += [("graph PDL, Triton PDL off", True, {"TPSERVE_GEMV_PDL": "1", "TPSERVE_TRITON_PDL": "0"}),
                     ("graph PDL, FlashInfer add+norm", True, {"TPSERVE_GEMV_PDL": "1", "TPSERVE_TRITON_ADD_RMSNORM": "0"})]
            if fuse == "1":
                unfused = logits(model, quantization, False, {"TPSERVE_GEMV_FUSE_NORM": "0", "TPSERVE_GEMV_PDL": "0"})
                rel = ((base - unfused).norm(dim=-1) / unfused.norm(dim=-1))
                print(f"{name} fused eager vs unfused eager: rel mean {rel.mean():.2e} max {rel.max():.2e}", flush=True)
            for label, graphs, env in runs:
                got = logits(model, quantization, graphs, base_env | env)
                rel = ((got - base).norm(dim=-1) / base.norm(dim=-1))
                print(f"{name} fuse={fuse} {label:32s} vs eager no PDL: rel mean {rel.mean():.2e} max {rel.max():.2e} "
                      f"worst step {int(rel.argmax())}, bit-equal {torch.equal(got, base)}", flush=True)


if __name__ == "__main__":
    main()
