"""A tokenizer worker process: TokenizeRequest -> GenerateRequest for the scheduler.

Several workers may run; the API server's PUSH socket spreads requests over them. For each
request the worker registers it with the detokenizer first, then hands it to the scheduler, so
the registration is on its way before the first token can be. Invalid requests go back to the
API server as RequestRejected and never reach the scheduler.
"""

from __future__ import annotations

import logging
import multiprocessing
from dataclasses import dataclass

import zmq

from tpserve.message.endpoints import Endpoints
from tpserve.message.frontend import RequestRejected, TokenizeRequest, TokenizerInput
from tpserve.message.transport import Receiver, Sender
from tpserve.tokenizer.loader import load_tokenizer
from tpserve.tokenizer.prepare import InvalidRequest, PromptLimits, PromptPreparer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenizerConfig:
    model_dir: str
    limits: PromptLimits


def run_tokenizer(
    config: TokenizerConfig, endpoints: Endpoints, ack_queue: multiprocessing.Queue, worker_id: int
) -> None:
    preparer = PromptPreparer(load_tokenizer(config.model_dir), config.limits)
    ctx = zmq.Context()
    inbox: Receiver[TokenizerInput] = Receiver(ctx, endpoints.tokenizer, TokenizerInput, bind=False)
    to_scheduler = Sender(ctx, endpoints.scheduler)
    to_detokenizer = Sender(ctx, endpoints.detokenizer)
    to_api = Sender(ctx, endpoints.api)
    ack_queue.put(f"tokenizer {worker_id} ready")
    try:
        inbox.serve(lambda msg: _handle(msg, preparer, to_scheduler, to_detokenizer, to_api))
    finally:
        ctx.destroy(linger=0)


def _handle(
    req: TokenizeRequest,
    preparer: PromptPreparer,
    to_scheduler: Sender,
    to_detokenizer: Sender,
    to_api: Sender,
) -> None:
    try:
        prepared = preparer.prepare(req)
    except InvalidRequest as e:
        to_api.send(RequestRejected(rid=req.rid, message=e.message, param=e.param))
        return
    except Exception as e:  # a tokenizer bug must fail one request, not the server
        logger.exception("tokenizing request %d failed", req.rid)
        to_api.send(RequestRejected(rid=req.rid, message=f"tokenization failed: {e}", status=500))
        return
    to_detokenizer.send(prepared.register)
    to_scheduler.send(prepared.generate)
