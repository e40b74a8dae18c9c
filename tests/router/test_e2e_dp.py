"""End to end: a server of two data-parallel replicas of TP 2 on the CPU (four rank processes).
Requests sent at once spread over both replicas, and every greedy output equals a one-replica
server's; /metrics has each replica's; /flush_cache empties every replica's cache; /health
covers every rank of every replica."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest
from server_process import ServerProcess, metrics

from tpserve import LLM, SamplingParams

HEALTH_TIMEOUT_S = 4  # how long a rank may make no progress before /health (and the router) count it stalled
PROMPTS = [[3 + i, 40, 41, 42 + i % 4] + [50 + i] * (i % 6) for i in range(12)]


def start(model_dir: str, *extra: str) -> ServerProcess:
    srv = ServerProcess(["--model", model_dir, "--device", "cpu", "--served-model-name", "tiny", "--page-size", "4",
                         *extra])
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop()
        raise
    return srv


async def _complete_all(url: str, timeout: float = 300) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        async def one(prompt: list[int]) -> str:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        return await asyncio.gather(*(one(p) for p in PROMPTS))


def samples(url: str, name: str) -> dict[str, float]:
    """``{replica: value}`` of a labeled metric."""
    return {key.split('"')[1]: value for key, value in metrics(url).items() if key.startswith(f"{name}{{replica=")}


@pytest.fixture(scope="module")
def dp1_outputs(qwen3_dir) -> list[str]:
    """One replica's greedy texts (in this process: TP 2 and TP 1 agree token for token)."""
    with LLM(qwen3_dir, device="cpu") as llm:
        return [o.text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                              use_tqdm=False)]


def test_dp2_tp2_spreads_requests_and_equals_dp1(qwen3_dir, dp1_outputs):
    srv = start(qwen3_dir, "--tp-size", "2", "--dp-size", "2", "--health-timeout", str(HEALTH_TIMEOUT_S))
    try:
        outputs = asyncio.run(_complete_all(srv.url))
        assert outputs == dp1_outputs
        routed = samples(srv.url, "tpserve_router_requests_total")
        assert set(routed) == {"0", "1"} and min(routed.values()) >= 4, routed
        assert samples(srv.url, "tpserve_router_outstanding_tokens") == {"0": 0.0, "1": 0.0}
        admitted = samples(srv.url, "tpserve_scheduler_prompt_tokens_total")
        assert set(admitted) == {"0", "1"} and all(v > 0 for v in admitted.values()), admitted
        assert httpx.post(f"{srv.url}/flush_cache").status_code == 200
        # A tiny request to each replica afterwards carries fresh stats to the metrics.
        asyncio.run(_two_small(srv.url))
        assert all(v <= 1 for v in samples(srv.url, "tpserve_kv_pages_cached").values())
        assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
        pids = dict(re.findall(r"tpserve-(scheduler-dp\d-tp\d) \(pid (\d+)\)", srv.log))
        assert sorted(pids) == ["scheduler-dp0-tp0", "scheduler-dp0-tp1", "scheduler-dp1-tp0", "scheduler-dp1-tp1"]
        # Replica 1 stalls (its rank 0 stopped): once /health names it, every new request goes to replica 0 and
        # completes (they were routed to the stalled replica too, and hung).
        os.kill(int(pids["scheduler-dp1-tp0"]), signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60
            while (health := httpx.get(f"{srv.url}/health")).status_code == 200:
                assert time.monotonic() < deadline, "/health never saw the stalled replica"
                time.sleep(0.2)
            assert "of replica 1" in health.json()["error"]["message"], health.text
            before = samples(srv.url, "tpserve_router_requests_total")
            assert asyncio.run(_complete_all(srv.url, timeout=60)) == dp1_outputs
            after = samples(srv.url, "tpserve_router_requests_total")
            assert after == {"0": before["0"] + len(PROMPTS), "1": before["1"]}, (before, after)
            assert "replica(s) 1 make no progress" in srv.log
        finally:
            os.kill(int(pids["scheduler-dp1-tp0"]), signal.SIGCONT)
        # A rank of replica 1 dies: the server shuts down, naming it.
        os.kill(int(pids["scheduler-dp1-tp1"]), signal.SIGKILL)
        assert srv.proc.wait(60) == 1
        assert "tpserve-scheduler-dp1-tp1 exited (killed by SIGKILL)" in srv.log
    finally:
        srv.stop()


async def _two_small(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(*(client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 1})
                               for _ in range(2)))

