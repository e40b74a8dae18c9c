"""Data-parallel replicas on two GPUs: LLM(dp_size=2) puts one replica on each GPU, and its
greedy outputs equal one replica's (each prompt alone, so both run the same batch shapes and
kernels); the server at --dp-size 2 spreads concurrent requests over both and frees both GPUs
on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("DP 2 needs two CUDA GPUs", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "launch"))
import httpx  # noqa: E402
from server_process import ServerProcess  # noqa: E402

from tpserve import LLM, SamplingParams  # noqa: E402

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PROMPTS = [[11 + i, 12, 13 + 2 * i] + [40 + i] * (i % 7) for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tpserve.tiny import make_tiny_model

    return make_tiny_model(
        str(tmp_path_factory.mktemp("tiny-dp2")), "qwen3", num_layers=4, hidden_size=512, num_heads=8,
        num_kv_heads=4, head_dim=128, intermediate_size=1024, seed=3,
    )


def used_gib(device: int) -> float:
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**30


def test_llm_dp2_uses_both_gpus_and_equals_dp1(model_dir):
    kwargs = dict(dtype="bfloat16", max_total_tokens=4096)
    with LLM(model_dir, **kwargs) as one:
        expected = [one.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]
    idle = [used_gib(0), used_gib(1)]
    with LLM(model_dir, dp_size=2, **kwargs) as two:
        assert all(used_gib(d) > idle[d] + 0.05 for d in (0, 1)), "a replica on each GPU"
        got = [two.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]
        assert two._driver.dispatch.router.routed == [4, 4]
    assert got == expected


async def _many(url: str, n: int) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(i: int) -> int:
            body = {"model": "tiny", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 32, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["usage"]["completion_tokens"]

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_server_dp2_spreads_and_stops(model_dir):
    srv = ServerProcess(["--model", model_dir, "--dp-size", "2", "--served-model-name", "tiny", "--dtype", "bfloat16"],
                        env=ENV)
    try:
        srv.wait_ready(300)
        assert asyncio.run(_many(srv.url, 64)) == [32] * 64
        text = httpx.get(f"{srv.url}/metrics").text
        for replica in ("0", "1"):
            line = next(ln for ln in text.splitlines() if ln.startswith(f'tpserve_router_requests_total{{replica="{replica}"}}'))
            assert float(line.split()[-1]) >= 16, text
    finally:
        assert srv.stop(signal.SIGTERM, timeout=60) == 0
