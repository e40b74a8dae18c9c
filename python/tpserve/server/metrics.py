"""Prometheus metrics of one server (own registry: no process-global state)."""

from __future__ import annotations

import time
from typing import Any, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tpserve.message import SchedulerStats
from tpserve.router.policy import Router

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class _SchedulerCollector:
    """Exports the latest SchedulerStats (forwarded by the detokenizer) at scrape time: one
    sample per family with one replica, one per replica (label ``replica``) with several."""

    def __init__(self, max_loras: int | None) -> None:
        self.stats = {0: SchedulerStats(running=0, waiting=0, kv_pages_used=0, kv_pages_total=0)}
        self.labeled = False  # set with data-parallel replicas
        self.max_loras = max_loras  # None: LoRA off

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        gauges = (
            ("tpserve_num_requests_running", "Requests being decoded (scheduler).", lambda s: s.running),
            ("tpserve_num_requests_waiting", "Requests waiting for admission (scheduler).", lambda s: s.waiting),
            ("tpserve_kv_pages_used", "KV-cache pages held by running requests.", lambda s: s.kv_pages_used),
            ("tpserve_kv_pages_cached", "KV-cache pages holding evictable cached prefixes.",
             lambda s: s.kv_pages_cached),
            ("tpserve_kv_pages_total", "KV-cache pages in all.", lambda s: s.kv_pages_total),
            ("tpserve_prefix_cache_hit_rate", "Share of admitted prompt tokens served from the prefix cache.",
             lambda s: s.cached_tokens_total / s.prompt_tokens_total if s.prompt_tokens_total else 0.0),
        )
        counters = (
            ("tpserve_scheduler_prompt_tokens", "Prompt tokens admitted by the scheduler.",
             lambda s: s.prompt_tokens_total),
            ("tpserve_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
             lambda s: s.cached_tokens_total),
            ("tpserve_kv_pages_evicted", "Cached KV pages evicted.", lambda s: s.evicted_pages_total),
            ("tpserve_preemptions", "Requests preempted under KV-cache pressure.", lambda s: s.preemptions_total),
            ("tpserve_spec_draft_tokens", "Speculative decoding: draft tokens proposed.", lambda s: s.draft_tokens_total),
            ("tpserve_spec_accepted_tokens", "Speculative decoding: draft tokens accepted.",
             lambda s: s.accepted_tokens_total),
        )
        for kind, families in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, doc, value in families:
                if not self.labeled:
                    yield kind(name, doc, value=value(self.stats[0]))
                    continue
                family = kind(name, doc, labels=["replica"])
                for replica, stats in sorted(self.stats.items()):
                    family.add_metric([str(replica)], value(stats))
                yield family
        if self.max_loras is not None:
            yield self._lora_info()

    def _lora_info(self) -> GaugeMetricFamily:
        """vLLM's ``vllm:lora_requests_info`` (the Gateway API inference extension's LoRA-affinity routing reads it):
        the adapters of running and waiting requests as comma-separated label values, the time as its value."""
        labels = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=labels + (["engine"] if self.labeled else []))
        for replica, stats in sorted(self.stats.items()):
            values = [str(self.max_loras), ",".join(stats.running_loras), ",".join(stats.waiting_loras)]
            family.add_metric(values + ([str(replica)] if self.labeled else []), time.time())
        return family


class _RouterCollector:
    """The data-parallel router's view: requests sent to and tokens outstanding on each replica."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        routed = CounterMetricFamily("tpserve_router_requests", "Requests the router sent to each replica.",
                                     labels=["replica"])
        load = GaugeMetricFamily("tpserve_router_outstanding_tokens",
                                 "Tokens (prompt and generated) of unfinished requests on each replica.",
                                 labels=["replica"])
        for replica in range(self.router.dp_size):
            routed.add_metric([str(replica)], self.router.routed[replica])
            load.add_metric([str(replica)], self.router.loads[replica])
        yield routed
        yield load


# vLLM's names for the same series (its dashboards and autoscalers read them), each with its model_name label:
# vLLM's name -> tpserve's, and how a value is read from the tpserve family's sample (None: as it is)
VLLM_NAMES = {
    "vllm:num_requests_running": "tpserve_num_requests_running",
    "vllm:num_requests_waiting": "tpserve_num_requests_waiting",
    "vllm:prompt_tokens": "tpserve_prompt_tokens",
    "vllm:generation_tokens": "tpserve_generation_tokens",
    "vllm:request_success": "tpserve_requests_finished",
    "vllm:num_preemptions": "tpserve_preemptions",
    "vllm:prefix_cache_queries": "tpserve_scheduler_prompt_tokens",
    "vllm:prefix_cache_hits": "tpserve_prefix_cache_hit_tokens",
    "vllm:spec_decode_num_draft_tokens": "tpserve_spec_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "tpserve_spec_accepted_tokens",
    "vllm:time_to_first_token_seconds": "tpserve_time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "tpserve_inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds": "tpserve_e2e_request_latency_seconds",
}
_VLLM_LABELS = {"finish_reason": "finished_reason", "replica": "engine"}  # vLLM's label names


class _VllmNames:
    """The series of ``VLLM_NAMES`` again under vLLM's names and labels (``model_name``; ``finished_reason``,
    ``engine``), and vLLM's ``kv_cache_usage_perc`` (a fraction), read from the registry at scrape time."""

    def __init__(self, sources: list[Any], model_name: str) -> None:
        self.sources, self.model_name = sources, model_name  # the collectors of tpserve's series

    def collect(self) -> Iterator[Metric]:
        ours = {family.name: family for source in self.sources for family in source.collect()}
        for vllm, name in VLLM_NAMES.items():
            family = ours.get(name)
            if family is None:
                continue
            renamed = Metric(vllm, family.documentation, family.type)
            for s in family.samples:
                labels = {_VLLM_LABELS.get(k, k): v for k, v in s.labels.items()} | {"model_name": self.model_name}
                renamed.add_sample(vllm + s.name[len(name):], labels, s.value)
            yield renamed
        used, total = ours.get("tpserve_kv_pages_used"), ours.get("tpserve_kv_pages_total")
        if used is not None and total is not None:
            usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage (1: full).",
                                      labels=["model_name", "engine"])
            for u, t in zip(used.samples, total.samples):
                usage.add_metric([self.model_name, u.labels.get("replica", "0")], u.value / t.value if t.value else 0.0)
            yield usage


class ServerMetrics:
    def __init__(self, model_name: str = "", max_loras: int | None = None) -> None:
        """``model_name``: the ``model_name`` label of vLLM's names for the series (``VLLM_NAMES``); ``max_loras``:
        the adapters a batch may use, where LoRA is on (None: off)."""
        r = self.registry = CollectorRegistry()
        self._scheduler = _SchedulerCollector(max_loras)
        r.register(self._scheduler)
        self.prompt_tokens = Counter("tpserve_prompt_tokens", "Prompt tokens of requests that ran.", registry=r)
        self.generation_tokens = Counter("tpserve_generation_tokens", "Generated tokens.", registry=r)
        self.finished = Counter("tpserve_requests_finished", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):  # at 0 from the start, so rates work from the first scrape
            self.finished.labels(finish_reason=reason)
        self.rejected = Counter("tpserve_requests_rejected",
                                "Prompts the tokenizer refused (e.g. too long), each choice.", registry=r)
        self.http_responses = Counter("tpserve_http_responses", "HTTP responses by status code.", ["status"],
                                      registry=r)
        self.client_aborts = Counter("tpserve_client_disconnects",
                                     "Requests aborted because the client went away.", registry=r)
        self.ttft = Histogram("tpserve_time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tpserve_inter_token_latency_seconds", "Time between generated tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tpserve_e2e_request_latency_seconds", "Request latency, end to end.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_VllmNames([self._scheduler, self.prompt_tokens, self.generation_tokens, self.finished, self.ttft,
                                self.itl, self.e2e], model_name))
        self.server_load = 0  # generating and pooling calls in flight (TrackServerLoad), for GET /load

    def on_aborted_finish(self, finish_reason: str) -> None:
        """An aborted request's last output arrived: how did the scheduler end it?"""
        self.finished.labels(finish_reason=finish_reason).inc()

    def on_stats(self, stats: SchedulerStats) -> None:
        self._scheduler.stats[stats.replica] = stats

    def watch_router(self, router: Router) -> None:
        """Data-parallel replicas: scheduler metrics per replica, and the router's own."""
        self._scheduler.labeled = True
        self._scheduler.stats = {
            d: SchedulerStats(running=0, waiting=0, kv_pages_used=0, kv_pages_total=0, replica=d)
            for d in range(router.dp_size)
        }
        self.registry.register(_RouterCollector(router))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CountResponses:
    """ASGI middleware: every HTTP response's status code into ``tpserve_http_responses_total`` (the 4xx refused
    by validation, by the body-size limit or by a handler, which never reach the tokenizer, included)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.http_responses.labels(status=str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:  # Starlette's outermost middleware answers it with a 500, past this one
                self.metrics.http_responses.labels(status="500").inc()
            raise


# vLLM's load-aware routes (its load_aware_call), as tpserve serves them (/v1/classify too, /classify's twin)
LOAD_AWARE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/pooling", "/classify",
                              "/v1/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"})


class TrackServerLoad:
    """ASGI middleware (--enable-server-load-tracking, vLLM's): ``metrics.server_load`` counts the calls to
    ``LOAD_AWARE_PATHS`` in flight, a stream until its last chunk is sent, a refused call until its error is."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].removeprefix(scope.get("root_path", "")) not in LOAD_AWARE_PATHS:
            return await self.app(scope, receive, send)
        self.metrics.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.metrics.server_load -= 1


class RequestTimer:
    """Latency bookkeeping of one backend request (one rid). ``shown`` False: its generated token is not shown
    (``echo`` with ``max_tokens`` 0), so only its prompt counts."""

    def __init__(self, metrics: ServerMetrics, shown: bool = True) -> None:
        self._metrics = metrics
        self._shown = shown
        self._start = time.monotonic()
        self._last: float | None = None
        self._prompt_counted = False

    def on_output(self, new_tokens: int, prompt_tokens: int, embedded: bool = False) -> None:
        """``embedded``: the output is an embedding request's answer (its prompt counts, no token comes)."""
        m = self._metrics
        if new_tokens <= 0 and not embedded:
            return
        now = time.monotonic()
        if not self._prompt_counted and prompt_tokens:
            m.prompt_tokens.inc(prompt_tokens)
            self._prompt_counted = True
        if not self._shown or new_tokens <= 0:
            return
        m.generation_tokens.inc(new_tokens)
        if self._last is None:
            m.ttft.observe(now - self._start)
        else:
            gap = (now - self._last) / new_tokens
            for _ in range(new_tokens):
                m.itl.observe(gap)
        self._last = now

    def on_finish(self, finish_reason: str) -> None:
        if not self._shown and finish_reason not in ("abort", "error"):
            finish_reason = "length"  # as the response says: the hidden token's own reason is not shown
        self._metrics.finished.labels(finish_reason=finish_reason).inc()
        self._metrics.e2e.observe(time.monotonic() - self._start)
