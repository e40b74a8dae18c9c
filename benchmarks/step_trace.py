"""Where a run's time goes, step by step, the way the engine really runs (overlap scheduling).

``StepTracer`` wraps ``Scheduler.step``, ``Engine.prepare`` and ``Scheduler._start`` (together:
the step's launch) and (on CUDA) ``torch.cuda.Event.synchronize`` on the classes while it is entered
(benchmark-side; nothing in tpserve changes). For every scheduler step it records the host wall
time, the time blocked in CUDA event waits (inside ``LaunchedStep.result``: waiting for a step's
samples; inside the launch: waiting for the previous step's planned copies, wherever the engine
keeps that event), the step's composition, and, on CUDA, the step's device time between two
timing events recorded right before ``Engine.prepare`` and right after ``Scheduler._start`` on the
current stream. Nothing synchronizes in the hot loop: the events are resolved when the tracer
exits.

    with StepTracer() as tracer:
        llm.generate(...)
    summary = summarize(tracer.records, FloorModel.from_engine(engine, bandwidth))
    print_summary(summary)

Only an in-process engine (tp 1) is traced: spawned rank processes do not see the wrappers.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch
from common import expected_touched_experts, expert_bytes, kv_bytes_per_token, print_table, weight_bytes_per_decode_step
from tpserve.engine.engine import Engine
from tpserve.scheduler.scheduler import Scheduler

# One compact list per step in the JSON; times in ms, start relative to the tracer's entry.
STEP_FIELDS = [
    "start_ms", "wall_ms", "result_wait_ms", "planned_wait_ms", "launch_ms",
    "seqs", "prefill_tokens", "decode_seqs", "context_sum", "graph", "gpu_ms", "gap_ms",
]  # fmt: skip
MAX_JSON_STEPS = 8000  # ~175 bytes a step in write_json's indented JSON: at most ~1.4 MB
KINDS = ["prefill", "mixed", "decode-graph", "decode-eager", "no-launch"]
BATCH_BUCKETS = [(1, 8), (9, 32), (33, 64), (65, 128), (129, 256), (257, 1 << 30)]


@dataclass
class StepRecord:
    start: float  # perf_counter seconds
    end: float = 0.0
    result_wait: float = 0.0  # seconds in event waits outside Engine.launch (LaunchedStep.result)
    planned_wait: float = 0.0  # seconds in event waits inside Engine.launch (planned copies)
    launch: float = 0.0  # seconds inside Engine.launch, planned_wait included
    events: tuple | None = None  # (start, end) CUDA timing events
    # resolved at exit
    num_seqs: int = 0
    prefill_tokens: int = 0  # new tokens of sequences with more than one new token
    decode_seqs: int = 0  # sequences with exactly one new token
    context_sum: int = 0  # sum over sequences of prefix_len + new tokens
    graph: bool = False
    gpu_ms: float | None = None
    gap_ms: float | None = None  # device idle between the previous launched step's end and this start

    @property
    def wall_ms(self) -> float:
        return (self.end - self.start) * 1e3

    @property
    def busy_ms(self) -> float:
        """Host time in this step not spent waiting for the device."""
        return self.wall_ms - (self.result_wait + self.planned_wait) * 1e3

    @property
    def launched(self) -> bool:
        return self.num_seqs > 0

    @property
    def kind(self) -> str:
        if not self.launched:
            return "no-launch"
        if self.prefill_tokens:
            return "mixed" if self.decode_seqs else "prefill"
        return "decode-graph" if self.graph else "decode-eager"


def _count_composition(record: StepRecord, seqs: list, runner: object) -> None:
    for s in seqs:
        n = len(s.token_ids)
        if n > 1:
            record.prefill_tokens += n
        else:
            record.decode_seqs += 1
        record.context_sum += s.prefix_len + n
    record.num_seqs = len(seqs)
    record.graph = runner is not None and runner.can_run(seqs)


class StepTracer:
    """Context manager: while entered, every ``Scheduler.step`` of this process is recorded in
    ``records`` (the wrappers are installed on the classes and removed at exit)."""

    def __init__(self, cuda: bool | None = None) -> None:
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.records: list[StepRecord] = []
        self.wall_ms = 0.0  # from entry to exit
        self.gpu_span_ms: float | None = None  # device timeline from entry to exit
        self.gpu_head_ms: float | None = None  # entry to the first step's start event
        self.gpu_tail_ms: float | None = None  # the last step's end event to exit
        self._current: StepRecord | None = None
        self._in_launch = False
        self._saved: dict[tuple[type, str], object] = {}
        self._origin = 0.0
        self._origin_event = None
        self._final_event = None

    # ---- installing the wrappers ----
    def __enter__(self):  # -> Self
        self._install()
        if self.cuda:
            self._origin_event = torch.cuda.Event(enable_timing=True)
            self._origin_event.record()
        self._origin = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_ms = (time.perf_counter() - self._origin) * 1e3
        if self.cuda:
            self._final_event = torch.cuda.Event(enable_timing=True)
            self._final_event.record()
        self._uninstall()
        self._resolve()

    def _patch(self, cls: type, name: str, wrapper) -> None:
        self._saved[(cls, name)] = cls.__dict__[name]
        wrapper.__wrapped__ = cls.__dict__[name]
        setattr(cls, name, wrapper)

    def _uninstall(self) -> None:
        for (cls, name), original in self._saved.items():
            setattr(cls, name, original)
        self._saved.clear()

    def _install(self) -> None:
        tracer = self
        step, prepare, start = Scheduler.step, Engine.prepare, Scheduler._start

        def traced_step(scheduler, *args, **kwargs):
            record = StepRecord(time.perf_counter())
            tracer._current = record
            try:
                return step(scheduler, *args, **kwargs)
            finally:
                record.end = time.perf_counter()
                tracer._current = None
                tracer.records.append(record)

        # A step's launch is Engine.prepare then Scheduler._start (the forward, and the sampling
        # unless grammar masks defer it; the deferred sampling of the step before may come between
        # them); the device interval spans both.
        def traced_prepare(engine, seqs, *args, **kwargs):
            record = tracer._current
            if record is None:  # not called from a scheduler step
                return prepare(engine, seqs, *args, **kwargs)
            begin = time.perf_counter()
            if tracer.cuda:
                record.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                record.events[0].record()
            tracer._in_launch = True
            try:
                return prepare(engine, seqs, *args, **kwargs)
            finally:
                tracer._in_launch = False
                record.launch += time.perf_counter() - begin
                # Counted now, not kept: holding every step's inputs would give the garbage
                # collector a growing heap to scan and distort the run being measured.
                _count_composition(record, seqs, engine.graph_runner)

        def traced_start(scheduler, *args, **kwargs):
            record = tracer._current
            if record is None:
                return start(scheduler, *args, **kwargs)
            begin = time.perf_counter()
            tracer._in_launch = True
            try:
                return start(scheduler, *args, **kwargs)
            finally:
                tracer._in_launch = False
                if tracer.cuda and record.events is not None:
                    record.events[1].record()
                record.launch += time.perf_counter() - begin

        self._patch(Scheduler, "step", traced_step)
        self._patch(Engine, "prepare", traced_prepare)
        self._patch(Scheduler, "_start", traced_start)
        if self.cuda:
            synchronize = torch.cuda.Event.synchronize

            def traced_synchronize(event, *args, **kwargs):
                record = tracer._current
                if record is None:
                    return synchronize(event, *args, **kwargs)
                begin = time.perf_counter()
                try:
                    return synchronize(event, *args, **kwargs)
                finally:
                    waited = time.perf_counter() - begin
                    if tracer._in_launch:
                        record.planned_wait += waited
                    else:  # LaunchedStep.result, the scheduler's only event wait
                        record.result_wait += waited

            self._patch(torch.cuda.Event, "synchronize", traced_synchronize)

    # ---- after the run ----
    def _resolve(self) -> None:
        if not self.cuda:
            return
        torch.cuda.synchronize()
        timed = [r for r in self.records if r.events is not None]
        previous_end = None
        for record in timed:
            start_event, end_event = record.events
            record.gpu_ms = start_event.elapsed_time(end_event)
            if previous_end is not None:
                record.gap_ms = previous_end.elapsed_time(start_event)
            previous_end = end_event
        self.gpu_span_ms = self._origin_event.elapsed_time(self._final_event)
        if timed:
            self.gpu_head_ms = self._origin_event.elapsed_time(timed[0].events[0])
            self.gpu_tail_ms = timed[-1].events[1].elapsed_time(self._final_event)
        for record in timed:
            record.events = None

    def step_rows(self, limit: int = MAX_JSON_STEPS) -> list[list]:
        """Per-step records as compact lists (``STEP_FIELDS``), the first ``limit`` steps."""

        def ms(value: float | None, digits: int = 4) -> float | None:
            return None if value is None else round(value, digits)

        rows = []
        for r in self.records[:limit]:
            rows.append([
                ms((r.start - self._origin) * 1e3, 3), ms(r.wall_ms), ms(r.result_wait * 1e3),
                ms(r.planned_wait * 1e3), ms(r.launch * 1e3), r.num_seqs, r.prefill_tokens,
                r.decode_seqs, r.context_sum, int(r.graph), ms(r.gpu_ms), ms(r.gap_ms),
            ])  # fmt: skip
        return rows

    def to_json(self, summary: dict) -> dict:
        return {
            "summary": summary,
            "step_fields": STEP_FIELDS,
            "steps": self.step_rows(),
            "steps_truncated": len(self.records) > MAX_JSON_STEPS,
        }


@dataclass
class FloorModel:
    """A decode step's memory floor: (weights + KV of every sequence's context) / copy bandwidth.
    A mixture-of-experts step reads only the experts its tokens are routed to (expected under
    uniform routing)."""

    weight_base: float  # bytes read at any batch size, experts aside
    weight_per_row: float  # extra bytes per sequence (an untied embedding's rows)
    kv_per_token: int
    bandwidth: float  # bytes/s
    expert_bytes: float = 0.0  # every expert of every sparse layer
    num_experts: int = 0
    top_k: int = 0

    @classmethod
    def from_engine(cls, engine: Engine, bandwidth: float | None) -> FloorModel | None:
        if bandwidth is None:
            return None
        moe = engine.model_config.moe
        experts = float(expert_bytes(engine)) if moe else 0.0
        shape = (moe.num_experts, moe.top_k) if moe else (0, 0)
        model = cls(0.0, 0.0, kv_bytes_per_token(engine), bandwidth, experts, *shape)
        one, two = (weight_bytes_per_decode_step(engine, b) - model.experts_read(b) for b in (1, 2))
        return replace(model, weight_base=one - (two - one), weight_per_row=two - one)

    def experts_read(self, batch: int) -> float:
        if not self.num_experts:
            return 0.0
        return self.expert_bytes * expected_touched_experts(self.num_experts, self.top_k, batch) / self.num_experts

    def ms(self, batch: int, context_sum: int) -> float:
        weights = self.weight_base + batch * self.weight_per_row + self.experts_read(batch)
        return (weights + context_sum * self.kv_per_token) / self.bandwidth * 1e3


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _sum(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def summarize(tracer: StepTracer, floor: FloorModel | None = None) -> dict:
    records = tracer.records
    cuda = tracer.cuda and any(r.gpu_ms is not None for r in records)
    result_wait = sum(r.result_wait for r in records) * 1e3
    planned_wait = sum(r.planned_wait for r in records) * 1e3
    steps_wall = sum(r.wall_ms for r in records)
    totals = {
        "steps": len(records),
        "wall_ms": tracer.wall_ms,
        "steps_wall_ms": steps_wall,
        "outside_steps_ms": tracer.wall_ms - steps_wall,
        "cpu_busy_ms": tracer.wall_ms - result_wait - planned_wait,
        "result_wait_ms": result_wait,
        "planned_wait_ms": planned_wait,
        "gpu_busy_ms": _sum([r.gpu_ms for r in records]) if cuda else None,
        "gpu_gap_ms": (_sum([r.gap_ms for r in records]) or 0.0) if cuda else None,
        "gpu_head_ms": tracer.gpu_head_ms if cuda else None,
        "gpu_tail_ms": tracer.gpu_tail_ms if cuda else None,
        "gpu_span_ms": tracer.gpu_span_ms if cuda else None,
    }

    by_kind = []
    for kind in KINDS:
        group = [r for r in records if r.kind == kind]
        if not group:
            continue
        gpu = [r.gpu_ms for r in group if r.gpu_ms is not None]
        by_kind.append({
            "kind": kind,
            "steps": len(group),
            "new_tokens": sum(r.prefill_tokens + r.decode_seqs for r in group),
            "wall_ms": sum(r.wall_ms for r in group),
            "gpu_ms": sum(gpu) if gpu else None,
            "gpu_mean_ms": _mean(gpu),
            "cpu_busy_mean_ms": _mean([r.busy_ms for r in group]),
            "launch_mean_ms": _mean([(r.launch - r.planned_wait) * 1e3 for r in group]),
            "wall_mean_ms": _mean([r.wall_ms for r in group]),
        })  # fmt: skip

    decode_buckets = []
    decodes = [r for r in records if r.kind in ("decode-graph", "decode-eager")]
    for low, high in BATCH_BUCKETS:
        group = [r for r in decodes if low <= r.num_seqs <= high]
        if not group:
            continue
        gpu = [r.gpu_ms for r in group if r.gpu_ms is not None]
        row = {
            "batch": f"{low}-{high}" if high < 1 << 30 else f">{low - 1}",
            "steps": len(group),
            "graph_steps": sum(r.graph for r in group),
            "gpu_mean_ms": _mean(gpu),
            "cpu_busy_mean_ms": _mean([r.busy_ms for r in group]),
            "wall_mean_ms": _mean([r.wall_ms for r in group]),
            "context_sum_mean": _mean([r.context_sum for r in group]),
            "floor_ms": None,
            "gpu_x_floor": None,
        }
        if floor is not None:
            row["floor_ms"] = _mean([floor.ms(r.num_seqs, r.context_sum) for r in group])
            if gpu:
                row["gpu_x_floor"] = row["gpu_mean_ms"] / row["floor_ms"]
        decode_buckets.append(row)

    wall = tracer.wall_ms or 1.0
    kinds = {row["kind"]: row for row in by_kind}

    def share(names: tuple[str, ...], key: str) -> float:
        return sum(kinds[n][key] or 0.0 for n in names if n in kinds) / wall

    prefill_kinds, decode_kinds = ("prefill", "mixed"), ("decode-graph", "decode-eager")
    where = {
        # host view: wall time of the scheduler steps of each kind (with overlap a step's wall
        # includes waiting for the step before it), and the host time outside any step
        "host_prefill_mixed": share(prefill_kinds, "wall_ms"),
        "host_decode": share(decode_kinds, "wall_ms"),
        "host_no_launch": share(("no-launch",), "wall_ms"),
        "host_outside_steps": totals["outside_steps_ms"] / wall,
    }
    if cuda:  # device view: device time of each kind and device idle, over the run's wall
        where["gpu_prefill_mixed"] = share(prefill_kinds, "gpu_ms")
        where["gpu_decode"] = share(decode_kinds, "gpu_ms")
        idle = totals["gpu_gap_ms"] + (totals["gpu_head_ms"] or 0.0) + (totals["gpu_tail_ms"] or 0.0)
        where["gpu_idle"] = idle / wall
        where["gpu_idle_between_steps"] = totals["gpu_gap_ms"] / wall
    return {"totals": totals, "by_kind": by_kind, "decode_by_batch": decode_buckets, "where": where}


def _na(rows: list[dict]) -> list[dict]:
    return [{k: ("n/a" if v is None else v) for k, v in row.items()} for row in rows]


def print_summary(summary: dict, title: str = "Step trace") -> None:
    t, w = summary["totals"], summary["where"]

    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value:,.1f} ms"

    print(f"\n{title}: {t['steps']} scheduler steps in {ms(t['wall_ms'])} wall")
    print(
        f"  host busy {ms(t['cpu_busy_ms'])} (wall minus waits: results {ms(t['result_wait_ms'])}, "
        f"planned copies {ms(t['planned_wait_ms'])}); outside Scheduler.step {ms(t['outside_steps_ms'])}"
    )
    if t["gpu_busy_ms"] is not None:
        head_tail = (t["gpu_head_ms"] or 0.0) + (t["gpu_tail_ms"] or 0.0)
        print(
            f"  GPU busy {ms(t['gpu_busy_ms'])}, idle between steps {ms(t['gpu_gap_ms'])}, "
            f"before the first / after the last step {ms(head_tail)} (GPU span {ms(t['gpu_span_ms'])})"
        )
    else:
        print("  GPU timings n/a (no CUDA)")
    print("\nBy step kind (means per step):")
    print_table(
        _na(summary["by_kind"]),
        ["kind", "steps", "new_tokens", "wall_ms", "gpu_ms", "gpu_mean_ms", "cpu_busy_mean_ms",
         "launch_mean_ms", "wall_mean_ms"],
    )  # fmt: skip
    if summary["decode_by_batch"]:
        print("\nDecode steps by batch size (floor: weights + KV of the summed contexts over copy bandwidth):")
        print_table(
            _na(summary["decode_by_batch"]),
            ["batch", "steps", "graph_steps", "gpu_mean_ms", "cpu_busy_mean_ms", "wall_mean_ms",
             "context_sum_mean", "floor_ms", "gpu_x_floor"],
        )  # fmt: skip
    pct = "{:.1%}".format
    if "gpu_idle" in w:
        print(
            f"\nWhere the time goes (GPU timeline / wall): prefill+mixed {pct(w['gpu_prefill_mixed'])}, "
            f"decode {pct(w['gpu_decode'])}, GPU idle {pct(w['gpu_idle'])} "
            f"(between steps {pct(w['gpu_idle_between_steps'])})"
        )
    else:
        print("\nWhere the time goes (GPU timeline): n/a (no CUDA)")
    print(
        f"Where the time goes (host step wall / wall): prefill+mixed {pct(w['host_prefill_mixed'])}, "
        f"decode {pct(w['host_decode'])}, drain-only steps {pct(w['host_no_launch'])}, "
        f"outside steps {pct(w['host_outside_steps'])}"
    )
