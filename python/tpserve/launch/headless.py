"""A node other than node 0 of a multi-node job: its ranks only, no HTTP, no tokenizers.

Its ranks take their messages from rank 0 (on node 0) and stop when it says so: then this
process exits 0. A rank that dies, a node that fails (the ranks name it) or a signal stops the
node's ranks and ends it non-zero (0 for a signal).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from tpserve.launch.args import ServerArgs
from tpserve.launch.backend import Backend, ChildDied, StartupCancelled

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5


def run_headless(args: ServerArgs) -> int:
    engine = args.engine
    me = f"node {engine.node_rank}"
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        logger.info("%s: received %s: stopping its ranks", me, signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    backend = Backend(engine, args.log_level)
    logger.info("%s of %d: ranks %d-%d joining node 0 at %s (no HTTP server on this node)",
                me, engine.nnodes, backend.ranks.start, backend.ranks.stop - 1, engine.dist_init_addr)
    try:
        backend.start()
        backend.wait_ready(stop)
        logger.info("%s: ready", me)
        return _watch(backend, stop, me)
    except StartupCancelled:
        return 0
    except ChildDied as e:
        logger.error("%s: start-up failed: %s", me, e)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        backend.shutdown()


def _watch(backend: Backend, stop: threading.Event, me: str) -> int:
    while not stop.wait(WATCH_INTERVAL_S):
        codes = [p.exitcode for p in backend.procs]
        failed = [(p, code) for p, code in zip(backend.procs, codes) if code not in (None, 0)]
        if failed:
            logger.error("%s: %s: stopping this node", me, ChildDied(failed[0][0].name, failed[0][1]))
            return 1
        if all(code == 0 for code in codes):
            logger.info("%s: node 0 ended the job", me)
            return 0
    return 0
