"""Structured-output requests waiting for their grammar.

Every rank compiles each grammar itself, but a request must become runnable (or fail) at the same step
everywhere: rank 0 broadcasts what ``ready`` reports (tpserve.scheduler.process), and each rank then ``take``s
those requests, waiting for its own compile if it is behind.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

from tpserve.sampling_params import StructuredOutput
from tpserve.structured.grammar import GrammarCompiler, InvalidGrammar, RequestGrammar, new_matcher

logger = logging.getLogger(__name__)

R = TypeVar("R")


@dataclass
class _Waiting(Generic[R]):
    request: R
    spec: StructuredOutput
    compile: Future
    asked: float  # time.monotonic()


class GrammarWaitlist(Generic[R]):
    """Requests by id, each with its grammar's compile, in arrival order."""

    def __init__(self, compiler: GrammarCompiler, timeout_s: float) -> None:
        self.compiler = compiler
        self.timeout_s = timeout_s
        self._waiting: dict[int, _Waiting[R]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, rid: int) -> bool:
        return rid in self._waiting

    def requests(self) -> list[R]:
        return [waiting.request for waiting in self._waiting.values()]

    def add(self, rid: int, request: R, spec: StructuredOutput) -> None:
        self._waiting[rid] = _Waiting(request, spec, self.compiler.submit(spec), time.monotonic())

    def compile_of(self, rid: int) -> Future:
        return self._waiting[rid].compile

    def ready(self) -> list[tuple[int, bool]]:
        """(request, timed out) of the requests whose grammar has compiled (or failed) on this rank, or whose
        compile has taken longer than ``timeout_s``."""
        deadline = time.monotonic() - self.timeout_s
        return [(rid, not w.compile.done()) for rid, w in self._waiting.items()
                if w.compile.done() or w.asked < deadline]

    def take(self, rid: int, timed_out: bool = False) -> tuple[R, RequestGrammar | None, str | None] | None:
        """The request with its grammar, or with the error that ends it; None if it was aborted meanwhile.
        Waits for this rank's compile unless ``timed_out``."""
        waiting = self._waiting.pop(rid, None)
        if waiting is None:
            return None
        if timed_out:  # its compile goes on, on every rank: the same spec asked again once it is done is ready
            return waiting.request, None, (
                f"its {waiting.spec.kind} did not compile within {self.timeout_s:g} s (--grammar-compile-timeout): "
                "a simpler one compiles faster")
        try:
            return waiting.request, RequestGrammar(new_matcher(waiting.compile.result())), None
        except InvalidGrammar as e:
            return waiting.request, None, str(e)
        except Exception as e:  # e.g. no tokenizer files: fail this request, not the scheduler
            logger.exception("request %d: compiling its grammar failed", rid)
            return waiting.request, None, f"structured output is unavailable: {type(e).__name__}: {e}"

    def abort(self, rid: int) -> bool:
        waiting = self._waiting.pop(rid, None)
        if waiting is None:
            return False
        self._drop_compile(waiting)
        return True

    def _drop_compile(self, gone: _Waiting[R]) -> None:
        """A compile no other request waits for is forgotten (stopped if it has not started)."""
        if all(w.compile is not gone.compile for w in self._waiting.values()):
            self.compiler.forget(gone.spec, gone.compile)

    def close(self) -> None:
        self.compiler.close()
