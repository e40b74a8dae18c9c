"""The device's two ceilings, measured in the run whose other figures they bound: device copy
bandwidth (bytes read + written) and bf16 matmul rate (8192^3, random inputs, rotating sets).

    python benchmarks/ceilings.py --out out/ceilings.json
"""

from __future__ import annotations

import argparse

from common import copy_bandwidth, matmul_peak, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bandwidth, peak = copy_bandwidth(), matmul_peak()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    write_json(args.out, {"benchmark": "ceilings", "copy_bandwidth_Bps": bandwidth, "matmul_peak_flops": peak})


if __name__ == "__main__":
    main()
