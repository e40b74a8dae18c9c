"""Online serving benchmark: Poisson arrivals against a running tpserve (or any OpenAI) server.

    python -m tpserve --model <dir> --load-format dummy &          # start a server
    python benchmarks/serving.py --url http://127.0.0.1:8000 --rates 4,16,inf --num-requests 200

or let it start (and stop) a tpserve server at any TP size, with random weights:

    python benchmarks/serving.py --launch <dir with config.json + tokenizer> --tp-size 2 \
        --server-args "--mixed-prefill-tokens 0" --rates inf --num-requests 256

With --dp-sizes 1,2 it launches one server per data-parallel size in turn (and, for DP > 1, one
per --load-balance-methods entry), runs the same workload on each and prints each one's
throughput against DP 1's. --shared-prefix GROUPS:TOKENS makes every prompt one of GROUPS
random prefixes of TOKENS tokens followed by its own random part (the prefix cache's workload);
each row then also shows how the requests, prompt tokens and prefix-cache hits fell on the
replicas (from /metrics).

Prompts are random token ids (lengths randint(--min-input, --max-input)), sent to
/v1/completions with streaming, temperature 0.6, ignore_eos and a random output length. For each
request rate it prints TTFT, inter-token latency (ITL) and end-to-end latency p50/p90/p99, and
request and output-token throughput; --out writes the same as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99)}


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                      stream: bool = True) -> RequestResult:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.6,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last = start
    result = RequestResult(ok=False)
    if not stream:
        return await _one_whole(client, url, dict(body, stream=False, stream_options=None), start)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        result.ok = True
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def replica_counters(url: str) -> dict[str, dict[str, float]]:
    """Per-replica counters from /metrics (replica "0" for a server of one replica)."""
    names = {"tpserve_router_requests_total": "requests", "tpserve_scheduler_prompt_tokens_total": "prompt_tokens",
             "tpserve_prefix_cache_hit_tokens_total": "cached_tokens"}
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in names:
                counters = found.setdefault(sample.labels.get("replica", "0"), {})
                counters[names[sample.name]] = counters.get(names[sample.name], 0.0) + sample.value
    return found


def replica_deltas(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    out = {}
    for replica, values in sorted(after.items()):
        if replica in ("",):
            continue
        out[replica] = {k: v - before.get(replica, {}).get(k, 0.0) for k, v in values.items()}
        prompt = out[replica].get("prompt_tokens", 0.0)
        out[replica]["hit_rate"] = out[replica].get("cached_tokens", 0.0) / prompt if prompt else 0.0
    return out


async def _one_whole(client: httpx.AsyncClient, url: str, body: dict, start: float) -> RequestResult:
    """A non-streamed request: its latency only (TTFT is the whole latency)."""
    result = RequestResult(ok=False)
    try:
        response = await client.post(f"{url}/v1/completions", json={k: v for k, v in body.items() if v is not None})
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {response.text[:200]!r}"
            return result
        result.output_tokens = response.json()["usage"]["completion_tokens"]
        result.latency = result.ttft = time.perf_counter() - start
        result.ok = True
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_rate(args: argparse.Namespace, model: str, rate: float, workload) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        rng = random.Random(1)
        tasks = []
        start = time.perf_counter()
        for prompt, max_tokens in workload:
            tasks.append(asyncio.create_task(one_request(client, args.url, model, prompt, max_tokens, not args.no_stream)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "server": args.label,
        "rate": rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "ttft_ms": {k: v * 1e3 for k, v in percentiles([r.ttft for r in ok]).items()},
        "itl_ms": {k: v * 1e3 for k, v in percentiles([x for r in ok for x in r.itl]).items()},
        "e2e_ms": {k: v * 1e3 for k, v in percentiles([r.latency for r in ok]).items()},
    }


@contextmanager
def launched_server(args: argparse.Namespace) -> Iterator[str]:
    """``python -m tpserve`` on a free port with random weights; yields its URL, then SIGTERMs it."""
    cmd = [sys.executable, "-m", "tpserve", "--model", args.launch, "--tp-size", str(args.tp_size),
           "--load-format", "dummy", "--port", "0", *args.extra_server_args, *shlex.split(args.server_args)]
    log = open(args.server_log, "a") if args.server_log else None  # main truncates it once
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if log is not None:
                log.write(line)
                log.flush()
            m = re.search(r"listening on (http://\S+)", line)
            if m and not found:
                found.append(m.group(1))

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + args.launch_timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if found:
                try:
                    if httpx.get(f"{found[0]}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        else:
            raise RuntimeError(f"the server did not become ready (exit code {proc.poll()}); see --server-log")
        print(f"server ready: {' '.join(cmd)}", flush=True)
        yield found[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if log is not None:
            log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--rates", default="4,16,inf", help="comma-separated request rates (req/s); inf = all at once")
    parser.add_argument("--num-requests", default="200",
                        help="requests per rate: one number, or one per rate (comma-separated)")
    parser.add_argument("--min-input", type=int, default=100, help="shortest prompt (tokens)")
    parser.add_argument("--max-input", type=int, default=1024, help="longest prompt (tokens)")
    parser.add_argument("--min-output", type=int, default=100, help="shortest output (tokens)")
    parser.add_argument("--max-output", type=int, default=1024, help="longest output (tokens)")
    parser.add_argument("--vocab", type=int, default=10000, help="prompt token ids are drawn from [0, vocab)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--launch", default=None, metavar="MODEL_DIR",
                        help="start a tpserve server of this model (random weights) instead of using --url")
    parser.add_argument("--tp-size", type=int, default=1, help="with --launch: the server's TP size")
    parser.add_argument("--server-args", default="", help="with --launch: more server flags, one string")
    parser.add_argument("--server-log", default=None, help="with --launch: write the server's output here")
    parser.add_argument("--launch-timeout", type=float, default=300.0, help="with --launch: seconds to get ready")
    parser.add_argument("--dp-sizes", default="1",
                        help="with --launch: one server per data-parallel size (comma-separated), in turn")
    parser.add_argument("--load-balance-methods", default="cache_aware",
                        help="with --launch and a DP size > 1: one server per method (comma-separated)")
    parser.add_argument("--shared-prefix", default=None, metavar="GROUPS:TOKENS",
                        help="prompts start with one of GROUPS random prefixes of TOKENS tokens")
    parser.add_argument("--no-stream", action="store_true",
                        help="whole responses instead of streams (less client and server overhead; no TTFT/ITL)")
    args = parser.parse_args()
    args.label, args.extra_server_args = "", []
    if args.server_log:
        open(args.server_log, "w").close()
    if args.launch is None:
        return report(args, run(args))
    rows = []
    for dp_size in [int(d) for d in args.dp_sizes.split(",")]:
        for method in args.load_balance_methods.split(",") if dp_size > 1 else [None]:
            args.extra_server_args = ["--dp-size", str(dp_size)] + ([] if method is None else ["--load-balance-method", method])
            args.label = f"dp{dp_size}" + ("" if method is None else f" {method}")
            with launched_server(args) as url:
                args.url = url
                rows += run(args)
    report(args, rows)


def make_workload(args: argparse.Namespace, count: int) -> list[tuple[list[int], int]]:
    random.seed(0)
    prefixes: list[list[int]] = []
    if args.shared_prefix:
        groups, tokens = (int(x) for x in args.shared_prefix.split(":"))
        prefixes = [[random.randint(0, args.vocab - 1) for _ in range(tokens)] for _ in range(groups)]
    prompts = [(random.choice(prefixes) if prefixes else [])
               + [random.randint(0, args.vocab - 1) for _ in range(random.randint(args.min_input, args.max_input))]
               for _ in range(count)]
    outputs = [random.randint(args.min_output, args.max_output) for _ in range(count)]
    return list(zip(prompts, outputs))


def run(args: argparse.Namespace) -> list[dict]:
    """Every rate against the server at args.url; one row each."""
    model = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    rates = [float(r) for r in args.rates.split(",")]
    counts = [int(n) for n in str(args.num_requests).split(",")]
    if len(counts) == 1:
        counts *= len(rates)
    if len(counts) != len(rates):
        raise SystemExit(f"--num-requests gives {len(counts)} counts for {len(rates)} rates")
    workload = make_workload(args, max(counts))
    rows = []
    for rate, count in zip(rates, counts):
        before = replica_counters(args.url)
        row = asyncio.run(run_rate(args, model, rate, workload[:count]))
        row["model"] = model
        row["replicas"] = replica_deltas(before, replica_counters(args.url))
        rows.append(row)
    return rows


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    print(f"\nmodel {rows[0]['model'] if rows else '?'}, {args.num_requests} requests per rate, inputs "
          f"{args.min_input}-{args.max_input}{f' after a shared prefix {args.shared_prefix}' if args.shared_prefix else ''}, "
          f"outputs {args.min_output}-{args.max_output}")
    print(f"{'server':<22} {'rate':>6} {'ok':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT p50/p90/p99 ms':>24} "
          f"{'ITL p50/p90/p99 ms':>22} {'E2E p50/p99 s':>15}")
    base = {r["rate"]: r["output_throughput"] for r in rows if r["server"] in ("dp1", "")}
    for r in rows:
        t, i, e = r["ttft_ms"], r["itl_ms"], r["e2e_ms"]
        print(f"{r['server']:<22} {r['rate']:>6} {r['completed']:>5} {r['request_throughput']:>7.2f} "
              f"{r['output_throughput']:>10.0f} "
              f"{t['p50']:>8.0f}/{t['p90']:.0f}/{t['p99']:.0f} {i['p50']:>8.1f}/{i['p90']:.1f}/{i['p99']:.1f} "
              f"{e['p50'] / 1e3:>7.1f}/{e['p99'] / 1e3:.1f}")
        if r["server"] not in ("dp1", "") and base.get(r["rate"]):
            r["speedup_vs_dp1"] = r["output_throughput"] / base[r["rate"]]
            print(f"{'':<22} {r['speedup_vs_dp1']:.2f}x DP 1's output throughput at this rate")
        replicas = r["replicas"]
        if replicas:
            prompt = sum(v.get("prompt_tokens", 0.0) for v in replicas.values())
            cached = sum(v.get("cached_tokens", 0.0) for v in replicas.values())
            parts = ", ".join(f"{d}: {v.get('requests', r['completed']):.0f} req {v.get('prompt_tokens', 0):.0f} "
                              f"prompt tok hit {v['hit_rate']:.0%}" for d, v in replicas.items())
            print(f"{'':<22} replicas {parts}; prefix hit rate {cached / prompt if prompt else 0:.1%}")
        if r["failed"]:
            print(f"       {r['failed']} failed: {r['errors']}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
