"""The cost of structured output: decode throughput of a batch of JSON-schema requests against
the same batch unconstrained (issue 12's target: within 10%).

Both runs generate exactly ``--output-len`` tokens per request: the unconstrained requests
ignore EOS, and the schema (an array of at least 200 integers) cannot end sooner. A scheduler
step prepares step i+1 (``prepare``: inputs, attention plan, uploads) while the device runs step
i's forward, waits for step i's masks (``join``) and enqueues its sampling
(``sample_constrained``), then starts step i+1 (``start``: its masks go to the mask worker
thread, which accepts step i's tokens and fills them, and its forward is enqueued) and processes
step i's tokens (``wait``, ``process``). Weights are random
(``--load-format dummy``); the tokenizer comes from ``--tokenizer`` (xgrammar needs the
vocabulary). The first table splits each kind's step time into the scheduler's phases on the
main thread (``wait``: waiting for the device's tokens); the second, the worker thread's time
per step, overlapped with the main thread's (it costs the step only through ``join``).
``--inline-masks`` does the worker's jobs on the main thread instead, as before the worker.

    python benchmarks/structured_output.py --model ../shared/models/configs/Qwen3-0.6B \\
        --tokenizer ../shared/models/qwen3-tokenizer --out out/structured.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time

from common import device_name, print_table, setup_logging, write_json
from tpserve import LLM, SamplingParams
from tpserve.engine.engine import LaunchedStep
from tpserve.sampling_params import StructuredOutput
from tpserve.structured.worker import MaskWorker

SCHEMA = {
    "type": "object",
    "properties": {
        "values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 200},
        "label": {"type": "string", "maxLength": 16},
    },
    "required": ["values", "label"],
    "additionalProperties": False,
}


def model_dir(config_dir: str, tokenizer_dir: str) -> str:
    """A directory with the model's config and the tokenizer's files (symlinks)."""
    out = tempfile.mkdtemp(prefix="tpserve-structured-")
    for src in (config_dir, tokenizer_dir):
        for name in os.listdir(src):
            if not os.path.exists(os.path.join(out, name)) and os.path.isfile(os.path.join(src, name)):
                os.symlink(os.path.abspath(os.path.join(src, name)), os.path.join(out, name))
    return out


PHASES = ("_schedule", "_prepare", "_start", "_process", "_sample_constrained")
JOB = ("job", "job_wait", "job_accept", "job_fill")


class PhaseTimes:
    """Host seconds per scheduler phase (and waiting for the device's tokens, and for the masks)
    while enabled, by wrapping the in-process scheduler's methods (tp 1 runs the scheduler in this
    process). The mask jobs' time (waiting for the tokens, accept, fill) counts apart, as
    ``job_*``: on the worker thread it overlaps the main thread's; inline it is inside launch."""

    def __init__(self, llm: LLM, inline: bool) -> None:
        self.totals: dict[str, float] = {}
        self.steps = 0
        self.inline = inline
        self._in_job = threading.local()
        scheduler = llm._driver.scheduler  # type: ignore[union-attr]
        for name in PHASES + ("step",):
            setattr(scheduler, name, self._timed(name, getattr(scheduler, name)))
        LaunchedStep.result = self._timed("wait", LaunchedStep.result)
        masks, filler = scheduler.masks, scheduler.masks.filler
        filler.accept, filler.fill = self._timed("accept", filler.accept), self._timed("fill", filler.fill)
        masks._run = self._timed("job", masks._run)
        submit = masks.submit

        def timed_submit(*args, **kwargs):
            future = submit(*args, **kwargs)
            future.result = self._timed("join", future.result)
            return future

        masks.submit = timed_submit

    def _timed(self, name: str, fn):
        def wrapper(*args, **kwargs):
            in_job = getattr(self._in_job, "on", False)
            key = f"job_{name}" if in_job else name
            self._in_job.on = in_job or name == "job"
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._in_job.on = in_job
                self.totals[key] = self.totals.get(key, 0.0) + time.perf_counter() - start
                self.steps += name == "step"

        return wrapper

    def reset(self) -> None:
        self.totals, self.steps = {}, 0

    def per_step_ms(self) -> dict[str, float]:
        t = dict(self.totals)
        t["_process"] = t.get("_process", 0.0) - t.get("wait", 0.0)  # the wait is inside it
        t["_sample_constrained"] = t.get("_sample_constrained", 0.0) - t.get("join", 0.0)
        if self.inline:  # the jobs ran inside _start (submit)
            t["_start"] = t.get("_start", 0.0) - t.get("job", 0.0)
        main = PHASES + ("wait", "join") + (("job",) if self.inline else ())
        t["other"] = t.get("step", 0.0) - sum(t.get(n, 0.0) for n in main)
        return {name.strip("_"): 1e3 * v / max(self.steps, 1) for name, v in t.items()}


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], phases: PhaseTimes) -> dict:
    phases.reset()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"seconds": elapsed, "output_tokens": tokens, "tok_per_s": tokens / elapsed,
            "host_ms_per_step": phases.per_step_ms()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="directory with a config.json (weights are random)")
    parser.add_argument("--tokenizer", default=None, help="directory with the tokenizer files (default: --model's)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each kind; the best counts")
    parser.add_argument("--disable-overlap", action="store_true")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=256)
    parser.add_argument("--grammar-threads", type=int, default=0, help="0: auto")
    parser.add_argument("--inline-masks", action="store_true", help="accept and fill on the main thread")
    parser.add_argument("--switch-interval-us", type=float, default=0,
                        help="the GIL switch interval to run with (0: Python's, 5 ms)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    setup_logging()

    random.seed(0)
    top = min(10000, json.load(open(os.path.join(args.model, "config.json")))["vocab_size"] - 1)
    prompts = [[random.randint(0, top) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    base = dict(temperature=0.6, max_tokens=args.output_len)
    plain = [SamplingParams(seed=i, ignore_eos=True, **base) for i in range(args.num_requests)]
    schema = StructuredOutput("json_schema", json.dumps(SCHEMA))
    constrained = [SamplingParams(seed=i, structured=schema, **base) for i in range(args.num_requests)]

    model = model_dir(args.model, args.tokenizer) if args.tokenizer else args.model
    llm = LLM(model, load_format="dummy", disable_overlap=args.disable_overlap,
              cuda_graph_max_bs=args.cuda_graph_max_bs, grammar_threads=args.grammar_threads)
    if args.inline_masks:
        scheduler = llm._driver.scheduler  # type: ignore[union-attr]
        scheduler.masks.close()
        scheduler.masks = MaskWorker(scheduler.masks.filler, sorted(scheduler.eos_ids), threaded=False)
    if args.switch_interval_us > 0:
        sys.setswitchinterval(args.switch_interval_us / 1e6)
    args.switch_interval_us = sys.getswitchinterval() * 1e6
    phases = PhaseTimes(llm, args.inline_masks)
    run(llm, prompts[:4], constrained[:4], phases)  # warm-up: compiles the grammar (then cached), fills caches
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, params in (("unconstrained", plain), ("json_schema", constrained)):
            result = run(llm, prompts, params, phases)
            if name not in best or result["tok_per_s"] > best[name]["tok_per_s"]:
                best[name] = result
    llm.close()
    ratio = best["json_schema"]["tok_per_s"] / best["unconstrained"]["tok_per_s"]
    rows = [{"kind": k, **{m: round(v, 2) for m, v in r.items() if m != "host_ms_per_step"}} for k, r in best.items()]
    print_table(rows, ["kind", "output_tokens", "seconds", "tok_per_s"])
    steps = [{"kind": k, **{m: round(v, 3) for m, v in r["host_ms_per_step"].items()}} for k, r in best.items()]
    print("host ms per step on the main thread, by scheduler phase (join: waiting for the masks):")
    print_table(steps, ["kind", "step", "schedule", "prepare", "start", "wait", "process", "join", "sample_constrained",
                        "other"])
    where = "inline: inside launch" if args.inline_masks else "on the worker thread, overlapped with the main thread's"
    print(f"mask jobs ms per step ({where}):")
    print_table(steps, ["kind", *JOB])
    print(f"json_schema / unconstrained throughput: {ratio:.3f} (target >= 0.90), "
          f"GIL switch interval {args.switch_interval_us:.0f} us")
    write_json(args.out, {"device": device_name(), "args": vars(args), "results": best, "ratio": ratio})


if __name__ == "__main__":
    main()
