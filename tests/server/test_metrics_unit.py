"""ServerMetrics: vLLM's ``vllm:lora_requests_info`` (what the Gateway API inference extension's LoRA affinity reads)."""

from __future__ import annotations

import time

from tpserve.message import SchedulerStats
from tpserve.server.metrics import ServerMetrics


def lora_lines(metrics: ServerMetrics) -> list[str]:
    return [line for line in metrics.render().decode().splitlines() if line.startswith("vllm:lora_requests_info")]


def test_lora_requests_info_names_the_running_and_waiting_adapters():
    metrics = ServerMetrics("tiny", max_loras=2)
    metrics.on_stats(SchedulerStats(running=3, waiting=1, kv_pages_used=4, kv_pages_total=9,
                                    running_loras=["a", "b"], waiting_loras=["c"]))
    before = time.time()
    (line,) = lora_lines(metrics)
    labels, value = line.rsplit(" ", 1)
    assert labels == 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"}'
    assert before - 1 <= float(value) <= time.time() + 1, "its value is the time (the newest sample wins)"


def test_lora_requests_info_per_replica_and_absent_without_lora():
    from types import SimpleNamespace

    assert lora_lines(ServerMetrics("tiny")) == []
    metrics = ServerMetrics("tiny", max_loras=1)
    router = SimpleNamespace(dp_size=2, routed=[0, 0], loads=[0, 0])
    metrics.watch_router(router)
    metrics.on_stats(SchedulerStats(running=1, waiting=0, kv_pages_used=1, kv_pages_total=9, replica=1,
                                    running_loras=["sql"]))
    labels = [line.rsplit(" ", 1)[0] for line in lora_lines(metrics)]
    assert labels == [
        'vllm:lora_requests_info{engine="0",max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}',
        'vllm:lora_requests_info{engine="1",max_lora="1",running_lora_adapters="sql",waiting_lora_adapters=""}',
    ]
