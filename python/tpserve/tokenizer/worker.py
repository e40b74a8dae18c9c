"""A tokenizer worker process: TokenizeRequest -> GenerateRequest for the scheduler.

Several workers may run; the API server's PUSH socket spreads requests over them. For each
request the worker registers it with the detokenizer first, then hands it to the scheduler, so
the registration is on its way before the first token can be. Invalid requests go back to the
API server as RequestRejected and never reach the scheduler.

A long prompt (over LONG_PROMPT_CHARS) is tokenized on a background thread with its own
tokenizer, so the short requests behind it are not held up: tokenizers' encode releases the GIL
(measured: ten short encodes took under 1 ms while a 1 M-character encode ran for 1.5 s beside
them). The ZMQ sockets are shared under a lock, one thread at a time.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import zmq

from tpserve.message.endpoints import Endpoints
from tpserve.message.frontend import RequestRejected, TokenizeRequest, TokenizerInput
from tpserve.message.transport import Receiver, Sender
from tpserve.tokenizer.loader import load_tokenizer
from tpserve.tokenizer.prepare import InvalidRequest, PromptLimits, PromptPreparer

logger = logging.getLogger(__name__)

LONG_PROMPT_CHARS = 8192  # tokenizing this many characters takes ~10 ms


@dataclass(frozen=True)
class TokenizerConfig:
    model_dir: str
    limits: PromptLimits
    chat_template: str | None = None  # replaces the model's (--chat-template)


def run_tokenizer(
    config: TokenizerConfig, endpoints: Endpoints, ack_queue: multiprocessing.Queue, worker_id: int
) -> None:
    preparer = _preparer(config)
    long_preparer: list[PromptPreparer] = []  # the background thread's own, made on its first long prompt
    ctx = zmq.Context()
    inbox: Receiver[TokenizerInput] = Receiver(ctx, endpoints.tokenizer, TokenizerInput, bind=False)
    out = _Outbox(Sender(ctx, endpoints.scheduler), Sender(ctx, endpoints.detokenizer), Sender(ctx, endpoints.api))
    background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="long-prompts")

    def handle(req: TokenizeRequest) -> None:
        if _prompt_chars(req) > LONG_PROMPT_CHARS:
            background.submit(_handle_long, req, config, long_preparer, out)
        else:
            _handle(req, preparer, out)

    ack_queue.put(f"tokenizer {worker_id} ready")
    try:
        inbox.serve(handle)
    finally:
        background.shutdown(wait=False, cancel_futures=True)
        ctx.destroy(linger=0)


def _preparer(config: TokenizerConfig) -> PromptPreparer:
    tokenizer = load_tokenizer(config.model_dir)
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    return PromptPreparer(tokenizer, config.limits)


def _prompt_chars(req: TokenizeRequest) -> int:
    if req.text is not None:
        return len(req.text)
    return sum(len(m.get("content") or "") for m in req.messages or [] if isinstance(m.get("content"), str))


@dataclass
class _Outbox:
    """The worker's sending sockets, used by one thread at a time."""

    scheduler: Sender
    detokenizer: Sender
    api: Sender
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reject(self, rejection: RequestRejected) -> None:
        with self.lock:
            self.api.send(rejection)

    def forward(self, prepared) -> None:
        with self.lock:
            self.detokenizer.send(prepared.register)
            self.scheduler.send(prepared.generate)


def _handle_long(req: TokenizeRequest, config: TokenizerConfig, made: list[PromptPreparer], out: _Outbox) -> None:
    """On the background thread: a tokenizer of its own (not shared with the main thread's)."""
    if not made:
        made.append(_preparer(config))
    _handle(req, made[0], out)


def _handle(req: TokenizeRequest, preparer: PromptPreparer, out: _Outbox) -> None:
    try:
        prepared = preparer.prepare(req)
    except InvalidRequest as e:
        out.reject(RequestRejected(rid=req.rid, message=e.message, param=e.param))
        return
    except Exception as e:  # a tokenizer bug must fail one request, not the server
        logger.exception("tokenizing request %d failed", req.rid)
        out.reject(RequestRejected(rid=req.rid, message=f"tokenization failed: {e}", status=500))
        return
    out.forward(prepared)
