"""Running the HTTP server: bind, serve /health at once, start the backend, watch it, stop it.

The port is bound before anything is spawned (a busy port fails fast), and uvicorn serves from
the first moment, so /health answers 503 during start-up and 200 once every process is ready.
SIGINT/SIGTERM/SIGHUP, a dead child or a failed start-up all end in the same clean shut-down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import resource
import signal
import socket
import time
from typing import Callable, Iterator

import uvicorn

from tpserve.launch.args import ServerArgs
from tpserve.launch.backend import STOP_SIGNALS
from tpserve.launch.frontend import serving_backend, watch
from tpserve.scheduler.gc_control import freeze_startup_heap
from tpserve.server.api import AppState, create_app

logger = logging.getLogger(__name__)

HTTP_GRACEFUL_S = 2  # open connections get this long to finish when stopping
OPEN_FILES_TARGET = 65536


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the serve loop owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


# A request's headers must arrive within this many seconds of its first bytes (nginx's client_header_timeout is 60),
# and its body within BODY_TIMEOUT_S of its headers (nginx's client_body_timeout, 60, bounds the gap between reads
# only, which a body trickled a byte a minute passes): uvicorn has neither bound, so a client trickling a request held
# its connection (and, for a body, the handler waiting on it) forever.
HEADER_TIMEOUT_S = 30.0
BODY_TIMEOUT_S = 60.0


def _idle_timeout_protocol() -> type:
    """uvicorn's HTTP protocol (httptools where installed, else h11, as its "auto") with its keep-alive timer armed
    when a connection opens too (uvicorn arms it only after a response, so a connection that never sent a request
    was held forever, and enough of them took every file descriptor: no client got an answer, /health included),
    and a request whose headers are not complete ``HEADER_TIMEOUT_S`` after its first bytes, or whose body is not
    ``BODY_TIMEOUT_S`` after its headers, closed (slowloris)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class IdleTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
            self.read_deadline: asyncio.TimerHandle | None = None
            self.deadline_cycle: object = None  # the request whose body the deadline bounds; None: the next headers
            self.deadline_seconds = 0.0
            resume_reading = self.flow.resume_reading

            def resume_and_restart() -> None:  # the client gets a whole period once the server reads again
                paused = self.flow.read_paused
                resume_reading()
                if paused and self.read_deadline is not None:
                    self.read_deadline.cancel()
                    self.read_deadline = self.loop.call_later(self.deadline_seconds, self._read_too_slow)

            self.flow.resume_reading = resume_and_restart

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = self.cycle
            if cycle is None or cycle.response_complete:  # the next request's headers are arriving
                self._arm(None, HEADER_TIMEOUT_S)
            elif cycle.more_body:  # its headers are in, its body is arriving
                self._arm(cycle, BODY_TIMEOUT_S)
            else:  # the whole request is in: the app has it
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, cycle: object, seconds: float) -> None:
            if self.read_deadline is not None and self.deadline_cycle is cycle:
                return
            self._disarm()
            self.deadline_cycle, self.deadline_seconds = cycle, seconds
            self.read_deadline = self.loop.call_later(seconds, self._read_too_slow)

        def _disarm(self) -> None:
            if self.read_deadline is not None:
                self.read_deadline.cancel()
                self.read_deadline = None

        def _read_too_slow(self) -> None:
            self.read_deadline = None
            if self.flow.read_paused or getattr(self, "pipeline", None):
                # the server holds the reads back (a pipelined request queued behind a response, a body the app has
                # not read yet), not the client: the deadline starts again (and again when reading resumes)
                self.read_deadline = self.loop.call_later(self.deadline_seconds, self._read_too_slow)
            elif not self.transport.is_closing():
                self.transport.close()

    return IdleTimeoutProtocol


class AcceptErrorsOncePer(logging.Filter):
    """asyncio logs every failed accept() while the process is out of file descriptors: a probe's 1,100 idle
    connections logged it 328,825 times (150 MB) in 40 s. One such line every ``seconds`` s is enough."""

    def __init__(self, seconds: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.seconds, self.clock = seconds, clock
        self._last = -math.inf
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "out of system resource" not in record.getMessage():
            return True
        now = self.clock()
        if now - self._last < self.seconds:
            self.dropped += 1
            return False
        self._last = now
        return True


def raise_open_files_limit(target: int = OPEN_FILES_TARGET) -> None:
    """The soft limit on open files up to ``target`` (within the hard limit): each client connection holds one, and
    the common default of 1024 is a few hundred streaming clients (vLLM raises it too)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as e:
            logger.warning("cannot raise the open-files limit from %d to %d: %s", soft, wanted, e)


def run_http_server(args: ServerArgs) -> int:
    """Serve until a signal or a failure; return the process exit code."""
    raise_open_files_limit()
    logging.getLogger("asyncio").addFilter(AcceptErrorsOncePer())
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((args.host, args.port))
        except OSError as e:
            logger.error("cannot listen on %s:%d: %s", args.host, args.port, e.strerror or e)
            return 1
        sock.listen(2048)
        sock.setblocking(False)
        return asyncio.run(_serve(args, sock))


async def _serve(args: ServerArgs, sock: socket.socket) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, _on_signal, sig, stop)

    host, port = sock.getsockname()[:2]
    url = f"{'https' if args.tls else 'http'}://{'[' + host + ']' if ':' in host else host}:{port}"
    state = AppState(args)
    if args.log_level != "debug":  # uvicorn's start-up lines repeat ours (under the name uvicorn.error)
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    config = uvicorn.Config(
        create_app(state),
        log_config=None,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=HTTP_GRACEFUL_S,
        http=_idle_timeout_protocol(),  # a connection idle for timeout_keep_alive (5 s) is closed, a new one too
        ws="none",  # no websocket routes: an upgrade would also outlive the header deadline's timer
        **(args.tls.uvicorn_options() if args.tls else {}),
    )
    server = _Server(config)
    http_task = asyncio.create_task(server.serve(sockets=[sock]), name="http")
    if args.tls and args.enable_ssl_refresh:
        config.load()  # the context uvicorn serves with (serve() loads the config once), which refresh updates
        refresh = asyncio.create_task(args.tls.refresh(config.ssl, stop), name="tls-refresh")
        http_task.add_done_callback(lambda _: refresh.cancel())
    logger.info("listening on %s (starting up: /health is 503 until the model is loaded)", url)

    async def close_http() -> None:
        server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(http_task, HTTP_GRACEFUL_S + 2)

    async with serving_backend(args, state, stop, http_task, close_http) as running:
        if running is None:
            return 1 if not stop.is_set() else 0
        logger.info("ready: serving %r on %s", args.served_model_name, url)
        freeze_startup_heap()  # as vLLM's API server: a full collection under load no longer scans the imports
        return await watch(running.backend, stop, [http_task, *running.tasks])


def _on_signal(sig: int, stop: asyncio.Event) -> None:
    if not stop.is_set():
        logger.info("received %s: shutting down", signal.Signals(sig).name)
    stop.set()
