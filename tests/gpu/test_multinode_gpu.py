"""Multi-node TP on GPUs, two nodes simulated as two launches on one host with one GPU each
(CUDA_VISIBLE_DEVICES): NCCL across the "nodes", float32 greedy tokens equal transformers', and a
killed node stops the other within 30 s naming it (with NCCL, a dead peer is caught by the
heartbeats and the collective timeout, not by a closed socket)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("two simulated nodes need two CUDA GPUs", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "launch"))
from nodes_process import greedy, two_nodes  # noqa: E402
from reference import hf_greedy  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41], list(range(100, 137))]
MAX_TOKENS = 12
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def test_two_gpu_nodes_match_transformers_and_a_killed_node_stops_the_job(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3", head_dim=128, hidden_size=256)
    node_env = {0: {**ENV, "CUDA_VISIBLE_DEVICES": "0"}, 1: {**ENV, "CUDA_VISIBLE_DEVICES": "1"}}
    with two_nodes(model_dir, 2, device="cuda", node_env=node_env,
                   extra=["--dtype", "float32", "--served-model-name", "m", "--dist-timeout", "10"]) as job:
        url = job[0].wait_ready(300)
        from tpserve.tokenizer.loader import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
        for prompt in PROMPTS:
            expected = tokenizer.decode(hf_greedy(model_dir, prompt, MAX_TOKENS), skip_special_tokens=True)
            assert greedy(url, prompt, MAX_TOKENS) == expected
        started = time.monotonic()
        for p in job[1].descendants():
            p.kill()
        job[1].proc.kill()
        codes = job.wait_exits(30)
        assert codes[0] not in (None, 0) and time.monotonic() - started < 30, (codes, job[0].log)
        assert "rank 1 (node 1)" in job[0].log and "dead or unreachable" in job[0].log, job[0].log
