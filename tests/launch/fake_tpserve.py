"""``python fake_tpserve.py ARGS``: ``tpserve ARGS`` with the fake scheduler (fake_scheduler.py)
in place of the engine's, for the lifecycle and shell tests."""

from __future__ import annotations

import dataclasses
import sys

from tpserve.__main__ import serve
from tpserve.launch.args import parse_args

FAKE_SCHEDULER = "fake_scheduler:run_fake_scheduler"

if __name__ == "__main__":
    sys.exit(serve(dataclasses.replace(parse_args(), scheduler_entry=FAKE_SCHEDULER)))
