"""What every server child process runs first: logging, signals and the parent-death guard.

Children never outlive the server: on Linux the kernel kills them when the parent dies
(PR_SET_PDEATHSIG, for children started from the parent's main thread), and everywhere a daemon
thread exits the process once its parent is gone.
SIGINT and SIGHUP are ignored (a terminal's Ctrl-C or its closing reaches the whole process group; the parent
decides).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import multiprocessing.util
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator

from tqdm import tqdm

PARENT_POLL_S = 0.5
# The parent decides on these (a terminal's Ctrl-C, or its closing, reaches the whole process group): children ignore
# them from their first instruction, as they are started with them blocked (``started_with_signals_blocked``).
PARENT_SIGNALS = (signal.SIGINT, signal.SIGHUP)
LOG_FORMAT = "%(asctime)s %(levelname)s [%(processName)s] %(name)s: %(message)s"


class ChildCannotGoOn(BaseException):
    """Ends a child with exit code 1 and no traceback, its message logged by the child and reported to the parent
    (a BaseException, as SystemExit is, so that no ``except Exception`` on the way swallows it)."""


def setup_logging(level: str, log_file: str | None = None) -> None:
    """To stderr, or appended to ``log_file`` (the shell keeps the terminal for the conversation)."""
    target = {"filename": log_file} if log_file else {"stream": sys.stderr}
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, force=True, **target)
    # transformers writes its warnings to stderr by a handler of its own, so they reached the shell's terminal
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()


def child_main(entry: str, args: tuple, parent_pid: int, log_level: str, log_file: str | None = None,
               errors: Any = None, from_main_thread: bool = True) -> None:
    """Target of every spawned child: guard, then run ``entry(*args)`` (``entry``: "module:function"). An exception
    that ends it is also put on ``errors`` (a SimpleQueue) in one line, so that the parent can say why it stopped.
    ``from_main_thread``: the parent started it from its main thread."""
    for sig in PARENT_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PARENT_SIGNALS)
    setup_logging(log_level, log_file)
    _die_with_parent(parent_pid, from_main_thread)
    # tqdm's default lock is a multiprocessing RLock, a named semaphore that a child stopped by SIGTERM never
    # unlinks (the resource tracker then warns of a leak at shut-down); one process's bars need a thread lock.
    tqdm.set_lock(threading.RLock())
    module_name, _, function = entry.partition(":")
    try:
        getattr(importlib.import_module(module_name), function)(*args)
    except (Exception, ChildCannotGoOn) as e:
        if errors is not None:
            with contextlib.suppress(Exception):
                errors.put(f"{multiprocessing.current_process().name}: {one_line_error(e)}")
        if isinstance(e, ChildCannotGoOn):  # said and logged: exit 1 without a traceback
            raise SystemExit(1) from None
        raise
    # Returned normally: run multiprocessing's exit hooks (as Process._bootstrap would: they
    # release e.g. named semaphores), then skip the interpreter's slow finalization (about a
    # second with torch loaded), which would only delay the server's shut-down.
    multiprocessing.util._exit_function()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def started_with_signals_blocked() -> Iterator[None]:
    """Processes started inside begin with ``PARENT_SIGNALS`` blocked (a blocked mask survives fork and exec), so a
    Ctrl-C while a child imports torch does not end it with a traceback before ``child_main`` ignores it."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # starting its own process, it unblocks SIGINT: first, not inside
    old = signal.pthread_sigmask(signal.SIG_BLOCK, PARENT_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def one_line_error(error: BaseException, limit: int = 500) -> str:
    """``Type: message``'s first line (a ChildCannotGoOn's without its type), at most ``limit`` characters."""
    lines = str(error).strip().splitlines()
    kind = "" if isinstance(error, ChildCannotGoOn) else f"{type(error).__name__}: "
    text = f"{kind}{lines[0]}" if lines else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _die_with_parent(parent_pid: int, from_main_thread: bool) -> None:
    # The kernel's signal comes when the thread that started this process ends, not its process: from another
    # thread (an offline LLM built in a worker thread) only the watch thread below applies.
    if from_main_thread and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the guard was set
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)
