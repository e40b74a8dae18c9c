"""The scheduler's host time for speculative decoding's n-gram drafts: ``NgramConfig.propose`` for one request's
step, on histories of several lengths (a cyclic text, so every suffix recurs and each search finds drafts), median
of many calls. A drafted step runs it for each decoding request before the step can be planned, and a drafted step
is drained (not overlapped), so this time adds to the step's.

    python benchmarks/ngram_drafts.py --lengths 150,2000,20000,100000
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from common import print_table, write_json
from tpserve.scheduler.ngram import NgramConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="150,2000,20000,100000", help="history lengths, tokens")
    parser.add_argument("--period", type=int, default=40, help="the cyclic text's period, tokens")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--spec", default="4,1,3", help="num_speculative_tokens,prompt_lookup_min,prompt_lookup_max")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = NgramConfig(*(int(x) for x in args.spec.split(",")))
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        tokens = (np.arange(length, dtype=np.int64) % args.period) + 5
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            drafts = config.propose(tokens, config.num_speculative_tokens)
            times.append(time.perf_counter() - start)
        rows.append({"tokens": length, "drafts": len(drafts), "us_per_call": statistics.median(times) * 1e6})
    print_table(rows, ["tokens", "drafts", "us_per_call"])
    write_json(args.out, {"spec": args.spec, "period": args.period, "rows": rows})


if __name__ == "__main__":
    main()
