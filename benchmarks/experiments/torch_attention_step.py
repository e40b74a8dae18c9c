"""The CPU attention backend (``attention/torch_backend.py``) on one layer of a mixed step: one long prompt among
many decodes, as a CPU server's step holds them. Prints the seconds of ``prepare`` and ``attend``.

    python benchmarks/experiments/torch_attention_step.py --prompt 2048 --decodes 100 --context 200
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python"))

import torch

from tpserve.attention.torch_backend import TorchAttentionBackend
from tpserve.forward import SequenceInput
from tpserve.kvcache.pool import KVCachePool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=2048, help="the long prompt's tokens (a fresh prefill)")
    parser.add_argument("--decodes", type=int, default=100, help="decoding sequences in the same step")
    parser.add_argument("--context", type=int, default=200, help="each decode's cached tokens")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    page = 16
    pages = -(-args.prompt // page) + -(-(args.context + 1) // page) + 1
    pool = KVCachePool(1, pages + 1, page, args.kv_heads, args.head_dim, torch.float32, torch.device("cpu"))
    backend = TorchAttentionBackend(pool, args.heads, args.kv_heads, args.head_dim)
    decode_pages = list(range(1, 1 + -(-(args.context + 1) // page)))  # the decodes share pages: timing only
    seqs = [SequenceInput([1], args.context, decode_pages) for _ in range(args.decodes)]
    seqs.insert(len(seqs) // 2, SequenceInput([1] * args.prompt, 0, list(range(len(decode_pages) + 1, pages + 1))))
    start = time.perf_counter()
    meta = backend.prepare(seqs, torch.device("cpu"))
    prepared = time.perf_counter()
    q = torch.randn(sum(s.extend_len for s in seqs), args.heads, args.head_dim)
    backend.attend(0, q, meta)
    done = time.perf_counter()
    print(f"prompt {args.prompt} + {args.decodes} decodes of {args.context}: prepare {prepared - start:.3f} s, "
          f"attend {done - prepared:.3f} s (one layer, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
