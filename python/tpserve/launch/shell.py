"""``tpserve --shell``: chat with the model in the terminal, over the same processes as the
HTTP server (no HTTP). Line editing and history (kept across sessions) come from readline; the
conversation is kept across turns; slash commands change the settings (``/help`` lists them);
Ctrl-C stops the current answer, Ctrl-D quits. While the shell owns the terminal every process
logs to a file, whose path the banner shows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, TextIO

import zmq

from tpserve.launch.args import ServerArgs
from tpserve.launch.backend import Backend, ChildDied, ignore_stop_signals
from tpserve.launch.child import setup_logging
from tpserve.message.endpoints import Endpoints
from tpserve.message.frontend import RequestRejected, TokenizeRequest
from tpserve.parsers.reasoning import GraniteReasoningParser, ReasoningParser, create_reasoning_parser
from tpserve.sampling_params import SamplingParams
from tpserve.server.client import BackendEvent, BackendLink

logger = logging.getLogger(__name__)

POLL_MS = 200
HISTORY_LENGTH = 1000
HELP = """commands:
  /help                 this list
  /system TEXT          set the system prompt (/system alone clears it; starts a new conversation)
  /set temperature T    sampling temperature (0: greedy)
  /set max_tokens N     longest answer in tokens (/set max_tokens none: up to the context limit)
  /think on|off         Qwen3's thinking (enable_thinking in the chat template)
  /settings             show the settings
  /reset                forget the conversation
  /history              print the conversation
  /exit, Ctrl-D         quit (Ctrl-C stops an answer)"""
DIM, BOLD, RESET = "\033[2m", "\033[1m", "\033[0m"


@dataclass
class ShellSettings:
    temperature: float = 0.7  # the model's generation config's where it has one (ShellSettings.for_model)
    max_tokens: int | None = None
    system: str | None = None
    think: bool | None = None  # None: the template's default
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # the model's other sampling fields (top_p, ...)

    @classmethod
    def for_model(cls, sampling_defaults: dict[str, Any]) -> "ShellSettings":
        """The model's sampling defaults (``--generation-config``), with /set temperature and /set max_tokens over its
        temperature and max_new_tokens."""
        others = {name: value for name, value in sampling_defaults.items() if name not in ("temperature", "max_tokens")}
        return cls(temperature=sampling_defaults.get("temperature", cls.temperature),
                   max_tokens=sampling_defaults.get("max_tokens"), sampling_defaults=others)

    def params(self) -> SamplingParams:
        return SamplingParams(**self.sampling_defaults, temperature=self.temperature, max_tokens=self.max_tokens)

    def describe(self) -> str:
        think = "template default" if self.think is None else ("on" if self.think else "off")
        others = "".join(f", {name} {value}" for name, value in self.sampling_defaults.items())
        return (f"temperature {self.temperature:g}{others}, max_tokens {self.max_tokens or 'context limit'}, "
                f"thinking {think}, system prompt {self.system!r}")


class ShellClient(BackendLink):
    """Blocking link to the backend for one interactive user."""

    def __init__(self, endpoints: Endpoints) -> None:
        super().__init__(endpoints)
        self._events: queue.SimpleQueue[BackendEvent] = queue.SimpleQueue()

    def submit(
        self, messages: list[dict[str, Any]], params: SamplingParams, template_kwargs: dict[str, Any] | None = None
    ) -> int:
        request = TokenizeRequest(rid=self.new_rid(), params=params, messages=messages,
                                  chat_template_kwargs=template_kwargs)
        for data in self._watch([request], self._events):
            self._to_tokenizer.send(data)
        return request.rid

    def abort(self, rid: int) -> None:
        self._to_scheduler.send(self._aborting(rid))

    def poll(self, timeout_ms: int) -> list[BackendEvent]:
        """Outputs (ApiOutput / RequestRejected) of the answer in progress that arrived within the timeout."""
        if self._from_backend.poll(timeout_ms):
            while True:
                try:
                    data = self._from_backend.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                for again in self._route_message(data):
                    self._to_scheduler.send(again)
        events = []  # only the answer in progress's: an aborted answer's rid is no longer routed
        while not self._events.empty():
            events.append(self._events.get_nowait())
        return events


@dataclass
class _Answer:
    """One streamed answer: its reasoning/content split and its token count."""

    reasoning: bool
    parser: ReasoningParser | GraniteReasoningParser | None = None
    reasoning_parser: str | None = None  # --reasoning-parser (None: the <think> one)
    content: str = ""
    reasoning_shown: bool = False
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    last: str = ""

    @property
    def line_end(self) -> str:
        """What ends the answer's last line: nothing if it already ended."""
        return "" if self.last.endswith("\n") or not self.last else "\n"

    def add(self, text: str, prompt_in_reasoning: bool | None, final: bool) -> list[tuple[str, str]]:
        if not self.reasoning:
            parts = [("content", text)] if text else []
        else:
            if self.parser is None:
                self.parser = create_reasoning_parser(self.reasoning_parser, prompt_in_reasoning)
            split = self.parser.feed(text, final=final)
            parts = [(k, t) for k, t in (("reasoning", split.reasoning), ("content", split.content)) if t]
        if parts:
            self.last = parts[-1][1]
        return parts


class Shell:
    def __init__(
        self,
        client: ShellClient,
        dead_child: Callable[[], Exception | None],
        out: TextIO = sys.stdout,
        context_len: int | None = None,
        reasoning: bool = False,
        reasoning_parser: str | None = None,
        log_file: str | None = None,
        history_file: str | None = None,
        sampling_defaults: dict[str, Any] | None = None,
    ) -> None:
        self._client, self._dead_child, self._out = client, dead_child, out
        self._color = out.isatty()
        self._context_len, self._reasoning = context_len, reasoning
        self._reasoning_parser = reasoning_parser  # which splits the reasoning out, where it is on
        self._log_file, self._history_file = log_file, history_file
        self.settings = ShellSettings.for_model(sampling_defaults or {})
        self.history: list[dict[str, Any]] = []

    def run(self) -> None:
        readline = _readline(self._history_file)
        banner = "tpserve shell: type a message; /help lists the commands; Ctrl-C stops an answer, Ctrl-D quits."
        if self._log_file:
            banner += f"\nlogs: {self._log_file}"
        self._print(banner + "\n")
        try:
            while True:
                try:
                    text = _as_utf8(input(">>> ")).strip()
                except EOFError:
                    self._print("\n")
                    return
                except KeyboardInterrupt:
                    self._print("\n")
                    continue
                if text.startswith("/"):
                    if self._command(text) == "exit":
                        return
                elif text:
                    self._turn(text)
        finally:
            if readline is not None and self._history_file:
                with contextlib.suppress(OSError):
                    readline.write_history_file(self._history_file)

    # ---- commands ----
    def _command(self, text: str) -> str | None:
        name, _, arg = text.partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return "exit"
        if name == "/help":
            self._print(HELP + "\n")
        elif name == "/reset":
            self.history.clear()
            self._print("(conversation cleared)\n")
        elif name == "/history":
            self._print(f"({len(self.history)} messages)\n")
            for msg in self.history:
                self._print(f"[{msg['role']}] {msg['content']}\n")
        elif name == "/settings":
            self._print(f"({self.settings.describe()})\n")
        elif name == "/system":
            self.settings.system = arg or None
            self.history.clear()
            self._print(f"(system prompt {'set' if arg else 'cleared'}; new conversation)\n")
        elif name == "/think":
            if arg in ("on", "off"):
                self.settings.think = arg == "on"
                self._print(f"(thinking {arg})\n")
            else:
                self._print("usage: /think on|off\n")
        elif name == "/set":
            self._set(arg)
        else:
            self._print(f"unknown command {text!r}\n{HELP}\n")
        return None

    def _set(self, arg: str) -> None:
        key, _, value = arg.partition(" ")
        value = value.strip()
        try:
            if key == "temperature":
                temperature = _parse(float, value, "a number")
                SamplingParams(temperature=temperature)  # validates
                self.settings.temperature = temperature
            elif key == "max_tokens":
                tokens = None if value.lower() == "none" else _parse(int, value, "a whole number or none")
                SamplingParams(max_tokens=tokens)  # validates
                self.settings.max_tokens = tokens
            else:
                self._print(f"unknown setting {key!r}: /set temperature T or /set max_tokens N\n")
                return
        except ValueError as e:
            self._print(f"bad value {value!r} for {key}: {e}\n")
            return
        self._print(f"({self.settings.describe()})\n")

    # ---- one turn ----
    def _turn(self, text: str) -> None:
        settings = self.settings
        messages = self.history + [{"role": "user", "content": text}]
        system = [{"role": "system", "content": settings.system}] if settings.system else []
        params = settings.params()
        kwargs = None if settings.think is None else {"enable_thinking": settings.think}
        rid = self._client.submit(system + messages, params, kwargs)
        answer = _Answer(self._reasoning, reasoning_parser=self._reasoning_parser)
        try:
            if not self._stream(answer):
                return  # rejected: the conversation is unchanged
        except KeyboardInterrupt:
            self._client.abort(rid)
            self._print(f"{answer.line_end}(stopped)\n")
        self.history = messages + [{"role": "assistant", "content": answer.content}]

    def _stream(self, answer: _Answer) -> bool:
        """Show the answer as it comes; False if the request was rejected."""
        while True:
            dead = self._dead_child()
            if dead is not None:
                raise dead
            for event in self._client.poll(POLL_MS):
                if isinstance(event, RequestRejected):
                    self._print(f"error: {event.message}\n(the conversation is unchanged; /reset starts anew)\n")
                    return False
                self._show(answer, answer.add(event.text, event.prompt_in_reasoning, event.finish_reason is not None))
                answer.tokens = event.completion_tokens
                if event.finish_reason is not None:
                    if event.finish_reason == "error":
                        self._print(f"\nerror: {event.error}")
                    self._print(answer.line_end + self._notice(event.finish_reason, answer) + "\n")
                    return True

    def _show(self, answer: _Answer, parts: list[tuple[str, str]]) -> None:
        for kind, text in parts:
            if kind == "reasoning":
                if not answer.reasoning_shown:
                    answer.reasoning_shown = True
                    self._print(self._style(DIM, "[thinking] "))
                self._print(self._style(DIM, _printable(text)))
            else:
                if answer.reasoning_shown and not answer.content:
                    self._print("\n")
                answer.content += text
                self._print(_printable(text))

    def _notice(self, finish_reason: str, answer: _Answer) -> str:
        elapsed = max(time.monotonic() - answer.started, 1e-6)
        rate = self._style(DIM, f"({answer.tokens} tokens, {answer.tokens / elapsed:.1f} tok/s)")
        if finish_reason != "length":
            return rate
        if self.settings.max_tokens is not None and answer.tokens >= self.settings.max_tokens:
            cut = f"(cut at max_tokens {self.settings.max_tokens}: /set max_tokens N for longer answers)"
        else:
            cut = f"(cut at the context limit of {self._context_len} tokens: /reset starts a new conversation)"
        return self._style(BOLD, cut) + "\n" + rate

    def _style(self, code: str, text: str) -> str:
        return f"{code}{text}{RESET}" if self._color else text

    def _print(self, text: str) -> None:
        try:
            self._out.write(text)
            self._out.flush()
        except BrokenPipeError:  # the reader is gone (`| head`): stop quietly, as command-line tools do
            with contextlib.suppress(OSError, ValueError):  # no second error when Python flushes at exit
                os.dup2(os.open(os.devnull, os.O_WRONLY), self._out.fileno())
            raise SystemExit(0) from None


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _printable(text: str) -> str:
    """Model text as the terminal shows it: control characters (an ESC starts a terminal command) as U+FFFD; the
    conversation keeps the text as generated."""
    return _CONTROL.sub("\ufffd", text)


def _as_utf8(line: str) -> str:
    """A terminal line as text: bytes that are not UTF-8 (read as lone surrogates) become U+FFFD, which every later
    step can encode (they failed the request's encoding and ended the shell)."""
    try:
        return line.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # surrogates that no undecodable byte made
        return line.encode("utf-8", "replace").decode("utf-8")


def _parse(kind: Any, value: str, what: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"must be {what}") from None


def _readline(history_file: str | None) -> Any:
    try:
        import readline
    except ImportError:  # pragma: no cover - not on every platform
        return None
    readline.set_history_length(HISTORY_LENGTH)
    if history_file and os.path.exists(history_file):
        with contextlib.suppress(OSError):
            readline.read_history_file(history_file)
    return readline


def run_shell(args: ServerArgs) -> int:
    """Start the backend, chat until the user quits; return the exit code."""

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGHUP, on_sigterm)  # its terminal closed
    # Ctrl-C stops an answer: Python turns SIGINT into KeyboardInterrupt only if it was not
    # ignored at start-up, and a process started in the background of a non-interactive shell
    # (`cmd &`, CI runners) inherits it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from tpserve.tiny import cache_root

    state_dir = cache_root()
    try:
        os.makedirs(os.path.join(state_dir, "logs"), exist_ok=True)
    except OSError as e:
        print(f"error: cannot keep the shell's logs and history in {state_dir} (TPSERVE_CACHE): {e}", file=sys.stderr)
        return 1
    log_file = os.path.join(state_dir, "logs", f"shell-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")
    args = replace(args, log_file=log_file)
    setup_logging(args.log_level, log_file)
    print(f"loading {args.served_model_name} (logs: {log_file}) ...", flush=True)
    backend = Backend(args.engine, args.log_level, args)
    client = ShellClient(backend.endpoints)
    try:
        backend.start()
        backend.wait_ready()
        Shell(client, backend.dead_child, context_len=args.context_len, reasoning=args.reasoning_parser is not None,
              reasoning_parser=args.reasoning_parser, log_file=log_file, history_file=os.path.join(state_dir, "shell_history"),
              sampling_defaults=args.sampling_defaults).run()
        return 0
    except ChildDied as e:
        logger.error("%s", e)
        print(f"error: {e} (see {log_file})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C during start-up
        return 130
    finally:
        ignore_stop_signals()
        client.close()
        backend.shutdown()
