"""Online serving benchmark: Poisson arrivals against a running tpserve (or any OpenAI) server.

    python -m tpserve --model <dir> --load-format dummy &          # start a server
    python benchmarks/serving.py --url http://127.0.0.1:8000 --rates 4,16,inf --num-requests 200

or let it start (and stop) a tpserve server at any TP size, with random weights:

    python benchmarks/serving.py --launch <dir with config.json + tokenizer> --tp-size 2 \
        --server-args "--mixed-prefill-tokens 0" --rates inf --num-requests 256

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


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.6,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last = start
    result = RequestResult(ok=False)
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


async def run_rate(args: argparse.Namespace, model: str, rate: float, workload) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        rng = random.Random(1)
        tasks = []
        start = time.perf_counter()
        for prompt, max_tokens in workload:
            tasks.append(asyncio.create_task(one_request(client, args.url, model, prompt, max_tokens)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
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
           "--load-format", "dummy", "--port", "0", *shlex.split(args.server_args)]
    log = open(args.server_log, "w") if args.server_log else None
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
    args = parser.parse_args()
    if args.launch is None:
        return run(args)
    with launched_server(args) as url:
        args.url = url
        run(args)


def run(args: argparse.Namespace) -> None:
    model = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    rates = [float(r) for r in args.rates.split(",")]
    counts = [int(n) for n in str(args.num_requests).split(",")]
    if len(counts) == 1:
        counts *= len(rates)
    if len(counts) != len(rates):
        raise SystemExit(f"--num-requests gives {len(counts)} counts for {len(rates)} rates")
    random.seed(0)
    prompts = [[random.randint(0, args.vocab - 1) for _ in range(random.randint(args.min_input, args.max_input))]
               for _ in range(max(counts))]
    outputs = [random.randint(args.min_output, args.max_output) for _ in range(max(counts))]
    rows = []
    for rate, count in zip(rates, counts):
        rows.append(asyncio.run(run_rate(args, model, rate, list(zip(prompts, outputs))[:count])))
    print(f"\nmodel {model}, {args.num_requests} requests per rate, inputs {args.min_input}-{args.max_input}, "
          f"outputs {args.min_output}-{args.max_output}")
    print(f"{'rate':>6} {'ok':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT p50/p90/p99 ms':>24} "
          f"{'ITL p50/p90/p99 ms':>22} {'E2E p50/p99 s':>15}")
    for r in rows:
        t, i, e = r["ttft_ms"], r["itl_ms"], r["e2e_ms"]
        print(f"{r['rate']:>6} {r['completed']:>5} {r['request_throughput']:>7.2f} {r['output_throughput']:>10.0f} "
              f"{t['p50']:>8.0f}/{t['p90']:.0f}/{t['p99']:.0f} {i['p50']:>8.1f}/{i['p90']:.1f}/{i['p99']:.1f} "
              f"{e['p50'] / 1e3:>7.1f}/{e['p99'] / 1e3:.1f}")
        if r["failed"]:
            print(f"       {r['failed']} failed: {r['errors']}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
