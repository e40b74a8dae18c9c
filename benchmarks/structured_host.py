"""The host side of structured output without a model: 64 matchers of the structured_output
benchmark's schema over a real vocabulary, stepping through a recorded random walk of allowed
tokens. Per step it times the matchers' accept and mask fill done inline after simulated launch
work of ``--launch-ms`` (standing in for planning and launching the next forward), and the same
with the accept and fill on the mask worker thread while the main thread does that work. The
launch work is either Python (holding the GIL throughout: the worst case for the worker) or a
wait that releases the GIL (as waiting for the device or replaying a CUDA graph does). It also
checks that xgrammar releases the GIL: how much Python work the main thread gets done while a
thread fills masks without pause.

    python benchmarks/structured_host.py --tokenizer ../shared/models/qwen3-tokenizer
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable

import torch
from common import print_table, setup_logging, write_json
from structured_output import SCHEMA

from tpserve.sampling_params import StructuredOutput
from tpserve.structured.grammar import GrammarCompiler, MaskFiller, RequestGrammar, new_matcher
from tpserve.structured.mask import unpack_bitmask
from tpserve.structured.worker import MaskWorker, SampledRows


def python_work(seconds: float) -> int:
    """Busy Python (it needs the GIL) for ``seconds``; how many rounds it did."""
    rounds, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        rounds += len([i for i in range(20)])
    return rounds


def record_walk(compiled, rows: int, steps: int, vocab: int, seed: int) -> list[list[int]]:
    """Each step's tokens: a random allowed token per matcher."""
    gen = torch.Generator().manual_seed(seed)
    matchers = [new_matcher(compiled) for _ in range(rows)]
    filler = MaskFiller(vocab)
    walk = []
    for _ in range(steps):
        allowed = unpack_bitmask(filler.fill(matchers, list(range(rows)), rows), vocab).float()
        tokens = torch.multinomial(allowed, 1, generator=gen)[:, 0].tolist()
        filler.accept(matchers, tokens)
        walk.append(tokens)
    return walk


def run_steps(compiled, walk: list[list[int]], worker: MaskWorker, launch: Callable[[], object]) -> list[float]:
    """Seconds per step: submit the masks, do the launch work, wait for the masks."""
    rows = len(walk[0])
    fills = [(row, RequestGrammar(new_matcher(compiled))) for row in range(rows)]
    times = []
    for tokens in walk:
        start = time.perf_counter()
        job = worker.submit(fills, rows)
        launch()
        job.result()
        worker.sampled(SampledRows(lambda tokens=tokens: tokens, [(row, row, g) for row, g in fills]))
        times.append(time.perf_counter() - start)
    return times


def timed_parts(compiled, walk: list[list[int]], filler: MaskFiller) -> dict[str, float]:
    """Median ms of one accept and one fill of every matcher."""
    rows = len(walk[0])
    matchers = [new_matcher(compiled) for _ in range(rows)]
    accept, fill = [], []
    for tokens in walk:
        start = time.perf_counter()
        filler.fill(matchers, list(range(rows)), rows)
        middle = time.perf_counter()
        filler.accept(matchers, tokens)
        fill.append(middle - start)
        accept.append(time.perf_counter() - middle)
    return {"accept_ms": 1e3 * statistics.median(accept), "fill_ms": 1e3 * statistics.median(fill)}


def gil_share(compiled, walk: list[list[int]], filler: MaskFiller) -> float:
    """Python work done on the main thread while another thread fills masks without pause,
    relative to alone (near 1 when xgrammar releases the GIL)."""
    rows = len(walk[0])
    matchers = [new_matcher(compiled) for _ in range(rows)]
    stop = threading.Event()

    def fill_forever() -> None:
        while not stop.is_set():
            filler.fill(matchers, list(range(rows)), rows)

    alone = python_work(0.5)
    thread = threading.Thread(target=fill_forever)
    thread.start()
    shared = python_work(0.5)
    stop.set()
    thread.join()
    return shared / alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="directory with the tokenizer files")
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--stop-token-id", type=int, default=151645)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--launch-ms", type=float, default=1.4, help="simulated main-thread work per step")
    parser.add_argument("--grammar-threads", type=int, default=0, help="0: auto")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    setup_logging()

    compiler = GrammarCompiler(args.tokenizer, args.vocab_size, [args.stop_token_id])
    compiled = compiler.submit(StructuredOutput("json_schema", json.dumps(SCHEMA))).result()
    compiler.close()
    walk = record_walk(compiled, args.num_requests, args.steps, args.vocab_size, seed=0)
    filler = MaskFiller(args.vocab_size, max_threads=args.grammar_threads)
    parts = timed_parts(compiled, walk, filler)
    launch_s = args.launch_ms / 1e3
    rows = []
    for work, launch in (("python", lambda: python_work(launch_s)), ("gil-free wait", lambda: time.sleep(launch_s))):
        for name, threaded in (("inline", False), ("worker thread", True)):
            worker = MaskWorker(filler, [args.stop_token_id], threaded=threaded)
            run_steps(compiled, walk[:20], worker, launch)  # warm-up
            step_ms = 1e3 * statistics.median(run_steps(compiled, walk, worker, launch))
            worker.close()
            rows.append({"launch": work, "masks": name, "step_ms": step_ms, "over_launch_ms": step_ms - args.launch_ms})
    share = gil_share(compiled, walk, filler)
    print(f"{args.num_requests} matchers, median of {args.steps} steps: accept {parts['accept_ms']:.3f} ms, "
          f"fill {parts['fill_ms']:.3f} ms ({filler.max_threads} threads at most, "
          f"one per {MaskFiller.ROWS_PER_THREAD} rows)")
    print(f"step = {args.launch_ms} ms of Python launch work + accept + fill:")
    print_table(rows, ["launch", "masks", "step_ms", "over_launch_ms"])
    print(f"main thread's Python work while a thread fills masks nonstop: {share:.2f} of alone "
          "(near 1: xgrammar releases the GIL)")
    write_json(args.out, {"args": vars(args), **parts, "steps": rows, "gil_share": share})


if __name__ == "__main__":
    main()
