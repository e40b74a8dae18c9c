"""Prometheus metrics of one server (own registry: no process-global state)."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tpserve.message import SchedulerStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("tpserve_num_requests_running", "Requests being decoded (scheduler).", registry=r)
        self.waiting = Gauge("tpserve_num_requests_waiting", "Requests waiting for admission (scheduler).", registry=r)
        self.kv_pages_used = Gauge("tpserve_kv_pages_used", "KV-cache pages in use.", registry=r)
        self.kv_pages_total = Gauge("tpserve_kv_pages_total", "KV-cache pages in all.", registry=r)
        self.prompt_tokens = Counter("tpserve_prompt_tokens", "Prompt tokens of requests that ran.", registry=r)
        self.generation_tokens = Counter("tpserve_generation_tokens", "Generated tokens.", registry=r)
        self.finished = Counter("tpserve_requests_finished", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("tpserve_requests_rejected", "Requests refused before scheduling.", registry=r)
        self.client_aborts = Counter("tpserve_client_disconnects",
                                     "Requests aborted because the client went away.", registry=r)
        self.ttft = Histogram("tpserve_time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tpserve_inter_token_latency_seconds", "Time between generated tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tpserve_e2e_request_latency_seconds", "Request latency, end to end.",
                             buckets=_LATENCY_BUCKETS, registry=r)

    def on_stats(self, stats: SchedulerStats) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_pages_used.set(stats.kv_pages_used)
        self.kv_pages_total.set(stats.kv_pages_total)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latency bookkeeping of one backend request (one rid)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._start = time.monotonic()
        self._last: float | None = None
        self._prompt_counted = False

    def on_output(self, new_tokens: int, prompt_tokens: int) -> None:
        m = self._metrics
        if new_tokens <= 0:
            return
        now = time.monotonic()
        if not self._prompt_counted and prompt_tokens:
            m.prompt_tokens.inc(prompt_tokens)
            self._prompt_counted = True
        m.generation_tokens.inc(new_tokens)
        if self._last is None:
            m.ttft.observe(now - self._start)
        else:
            gap = (now - self._last) / new_tokens
            for _ in range(new_tokens):
                m.itl.observe(gap)
        self._last = now

    def on_finish(self, finish_reason: str) -> None:
        self._metrics.finished.labels(finish_reason=finish_reason).inc()
        self._metrics.e2e.observe(time.monotonic() - self._start)
