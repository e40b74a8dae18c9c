"""``tpserve --shell``: chat with the model in the terminal, over the same processes as the
HTTP server (no HTTP). Line editing and history come from readline; the conversation is kept
across turns; ``/reset`` forgets it, ``/history`` prints it; ``/exit`` or Ctrl-D quits; Ctrl-C
stops the current answer.
"""

from __future__ import annotations

import logging
import queue
import signal
import sys
from typing import Any, Callable, TextIO

import zmq

from tpserve.launch.args import ServerArgs
from tpserve.launch.backend import Backend, ChildDied
from tpserve.message.endpoints import Endpoints
from tpserve.message.frontend import RequestRejected, TokenizeRequest
from tpserve.sampling_params import SamplingParams
from tpserve.server.client import BackendEvent, BackendLink

logger = logging.getLogger(__name__)

POLL_MS = 200
BANNER = (
    "tpserve shell: type a message. /reset clears the conversation, /history shows it, "
    "/exit or Ctrl-D quits, Ctrl-C stops an answer."
)


class ShellClient(BackendLink):
    """Blocking link to the backend for one interactive user."""

    def __init__(self, endpoints: Endpoints) -> None:
        super().__init__(zmq.Context(), endpoints)
        self._events: queue.SimpleQueue[BackendEvent] = queue.SimpleQueue()

    def submit(self, messages: list[dict[str, Any]], params: SamplingParams) -> int:
        request = TokenizeRequest(rid=self.new_rid(), params=params, messages=messages)
        for data in self._watch([request], self._events):
            self._to_tokenizer.send(data)
        return request.rid

    def abort(self, rid: int) -> None:
        self._to_scheduler.send(self._aborting(rid))

    def poll(self, rid: int, timeout_ms: int) -> list[BackendEvent]:
        """Outputs (ApiOutput / RequestRejected) of ``rid`` that arrived within the timeout."""
        if self._from_backend.poll(timeout_ms):
            while True:
                try:
                    data = self._from_backend.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                for again in self._route_message(data):
                    self._to_scheduler.send(again)
        events = []  # only ``rid``'s: an aborted answer's rid is no longer routed
        while not self._events.empty():
            events.append(self._events.get_nowait())
        return events


class Shell:
    def __init__(self, client: ShellClient, check_backend: Callable[[], None], out: TextIO = sys.stdout) -> None:
        self._client = client
        self._check_backend = check_backend
        self._out = out
        self.history: list[dict[str, Any]] = []

    def run(self) -> None:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:  # pragma: no cover - not on every platform
            pass
        self._print(BANNER + "\n")
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                self._print("\n")
                return
            except KeyboardInterrupt:
                self._print("\n")
                continue
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return
            if text == "/reset":
                self.history.clear()
                self._print("(conversation cleared)\n")
                continue
            if text == "/history":
                self._print_history()
                continue
            self._turn(text)

    def _turn(self, text: str) -> None:
        messages = self.history + [{"role": "user", "content": text}]
        rid = self._client.submit(messages, SamplingParams(max_tokens=None))
        answer: list[str] = []
        try:
            finished = self._stream(rid, answer)
        except KeyboardInterrupt:
            self._client.abort(rid)
            self._print("\n(stopped)\n")
            finished = True
        if finished is None:
            return  # rejected: the conversation is unchanged
        self.history = messages + [{"role": "assistant", "content": "".join(answer)}]

    def _stream(self, rid: int, answer: list[str]) -> bool | None:
        while True:
            self._check_backend()
            for event in self._client.poll(rid, POLL_MS):
                if isinstance(event, RequestRejected):
                    self._print(f"error: {event.message}\n(the conversation is unchanged; /reset starts anew)\n")
                    return None
                if event.text:
                    answer.append(event.text)
                    self._print(event.text)
                if event.finish_reason is not None:
                    if event.finish_reason == "error":
                        self._print(f"\nerror: {event.error}")
                    self._print("\n")
                    return True

    def _print_history(self) -> None:
        self._print(f"({len(self.history)} messages)\n")
        for msg in self.history:
            self._print(f"[{msg['role']}] {msg['content']}\n")

    def _print(self, text: str) -> None:
        self._out.write(text)
        self._out.flush()


def run_shell(args: ServerArgs) -> int:
    """Start the backend, chat until the user quits; return the exit code."""

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    backend = Backend(args)
    client = ShellClient(backend.endpoints)

    def check_backend() -> None:
        dead = backend.dead_child()
        if dead is not None:
            raise dead

    try:
        backend.start()
        logger.info("loading %s ...", args.served_model_name)
        backend.wait_ready()
        Shell(client, check_backend).run()
        return 0
    except ChildDied as e:
        logger.error("%s", e)
        return 1
    except KeyboardInterrupt:  # Ctrl-C during start-up
        return 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        client.close()
        backend.shutdown()
