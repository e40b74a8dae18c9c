"""The detokenizer process: scheduler tokens -> text deltas for the API server."""

from __future__ import annotations

import multiprocessing

import zmq

from tpserve.message import BatchTokenOutput
from tpserve.message.endpoints import Endpoints
from tpserve.message.frontend import DetokenizeRegister, DetokenizerInput
from tpserve.message.transport import Receiver, Sender
from tpserve.tokenizer.detok_manager import DetokenizerManager
from tpserve.tokenizer.loader import load_tokenizer


def run_detokenizer(model_dir: str, endpoints: Endpoints, ack_queue: multiprocessing.Queue) -> None:
    manager = DetokenizerManager(load_tokenizer(model_dir))
    ctx = zmq.Context()
    inbox: Receiver[DetokenizerInput] = Receiver(ctx, endpoints.detokenizer, DetokenizerInput, bind=True)
    to_api = Sender(ctx, endpoints.api)
    to_scheduler = Sender(ctx, endpoints.scheduler)
    ack_queue.put("detokenizer ready")

    def handle(msg: DetokenizeRegister | BatchTokenOutput) -> None:
        result = manager.register(msg) if isinstance(msg, DetokenizeRegister) else manager.on_batch(msg)
        for abort in result.aborts:
            to_scheduler.send(abort)
        if result.api is not None:
            to_api.send(result.api)

    try:
        inbox.serve(handle)
    finally:
        ctx.destroy(linger=0)
