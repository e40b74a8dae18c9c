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

import functools
import logging
import multiprocessing
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import zmq

from tpserve.message.endpoints import Endpoints
from tpserve.message.frontend import RequestRejected, TokenizeRequest, TokenizerInput
from tpserve.message.transport import Receiver, Sender
from tpserve.tokenizer.loader import load_tokenizer
from tpserve.tokenizer.prepare import InvalidRequest, PreparedRequest, PromptLimits, PromptPreparer, prompt_chars

logger = logging.getLogger(__name__)

LONG_PROMPT_CHARS = 8192  # tokenizing this many characters takes ~10 ms


@dataclass(frozen=True)
class TokenizerConfig:
    model_dir: str
    limits: PromptLimits
    chat_template: str | None = None  # replaces the model's (--chat-template)
    default_template_kwargs: dict[str, Any] | None = None  # --default-chat-template-kwargs


def run_tokenizer(
    config: TokenizerConfig, endpoints: Endpoints, ack_queue: multiprocessing.Queue, worker_id: int, heartbeat=None
) -> None:
    preparer = _preparer(config)
    ctx = zmq.Context()
    inbox: Receiver[TokenizerInput] = Receiver(ctx, endpoints.tokenizer, TokenizerInput, bind=False)
    to_scheduler = Sender(ctx, endpoints.scheduler)
    to_detokenizer = Sender(ctx, endpoints.detokenizer)
    to_api = Sender(ctx, endpoints.api)
    lock = threading.Lock()  # the sockets, used by one thread at a time
    background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="long-prompts")

    @functools.cache
    def long_preparer() -> PromptPreparer:
        """The background thread's own tokenizer, made on its first long prompt."""
        return _preparer(config)

    def process(req: TokenizeRequest, preparer: PromptPreparer) -> None:
        prepared = _prepare(req, preparer)
        with lock:
            for choice in prepared:
                if isinstance(choice, RequestRejected):
                    to_api.send(choice)
                else:
                    to_detokenizer.send(choice.register)
                    to_scheduler.send(choice.generate)

    def handle(req: TokenizeRequest) -> None:
        if prompt_chars(req) > LONG_PROMPT_CHARS:
            background.submit(lambda: process(req, long_preparer()))
        else:
            process(req, preparer)

    ack_queue.put(f"tokenizer {worker_id} ready")
    try:
        inbox.serve(handle, heartbeat)
    finally:
        background.shutdown(wait=False, cancel_futures=True)
        ctx.destroy(linger=0)


def _preparer(config: TokenizerConfig) -> PromptPreparer:
    return PromptPreparer(load_tokenizer(config.model_dir, config.chat_template), config.limits,
                          default_template_kwargs=config.default_template_kwargs)


def _prepare(req: TokenizeRequest, preparer: PromptPreparer) -> list[PreparedRequest] | list[RequestRejected]:
    """Each choice's request, or each one's rejection (they share the prompt and its faults)."""
    try:
        return preparer.prepare_choices(req)
    except InvalidRequest as e:
        return [RequestRejected(rid=rid, message=e.message, param=e.param) for rid in req.choice_rids]
    except Exception as e:  # a tokenizer bug must fail one request, not the server
        logger.exception("tokenizing request %d failed", req.rid)
        return [RequestRejected(rid=rid, message=f"tokenization failed: {e}", status=500) for rid in req.choice_rids]
