"""``decode_latency.py`` with XQA launched without PDL when ``TPSERVE_XQA_PDL=0`` (session 9's
check of why whole bf16 batch-1 steps were not faster through XQA; ``gpu_suite.sh xqa_variants``)."""

import os
import runpy
import sys

sys.path.insert(0, "benchmarks")
from tpserve.attention import xqa  # noqa: E402

if os.environ.get("TPSERVE_XQA_PDL") == "0":
    run = xqa.XqaDecode.run

    def run_without_pdl(self, q, k_cache, v_cache, meta):
        kernel = self.kernel
        self.kernel = lambda *args, **kwargs: kernel(*args, **{**kwargs, "enable_pdl": False})
        try:
            return run(self, q, k_cache, v_cache, meta)
        finally:
            self.kernel = kernel

    xqa.XqaDecode.run = run_without_pdl
sys.argv = ["decode_latency.py", *sys.argv[1:]]
runpy.run_path("benchmarks/decode_latency.py", run_name="__main__")
