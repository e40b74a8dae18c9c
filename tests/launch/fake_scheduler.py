"""A stand-in scheduler for frontend tests: same sockets and messages as the real one, no model.

Each request "generates" its own prompt tokens again, cyclically (an echo), one token per step,
so outputs are deterministic, decodable and contain whatever text the prompt had (handy for stop
strings). It honours max_tokens ("length"), stop_token_ids and EOS ("stop", unless ignore_eos),
AbortRequest ("abort") and Shutdown, and reports stats like the real scheduler.

Env: FAKE_SCHEDULER_STEP_S (seconds per step, default 0.005), FAKE_SCHEDULER_FAIL=1 (exit with
code 3 at start-up, to test start-up failures), FAKE_SCHEDULER_START_DELAY_S (a slow model load).
EOS ids come from the model's config.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass

import msgspec
import zmq
from tpserve.config import ModelConfig
from tpserve.engine_config import EngineConfig
from tpserve.message import (
    AbortRequest,
    BatchTokenOutput,
    FlushCache,
    GenerateRequest,
    SchedulerInput,
    SchedulerStats,
    Shutdown,
    TokenOutput,
)
from tpserve.message.endpoints import Endpoints

KV_PAGES_TOTAL = 4096


@dataclass
class _Running:
    req: GenerateRequest
    generated: int = 0


def run_fake_scheduler(
    engine_config: EngineConfig, rank: int, endpoints: Endpoints, ack_queue: multiprocessing.Queue, heartbeat=None
) -> None:
    if os.environ.get("FAKE_SCHEDULER_FAIL") == "1":
        sys.exit(3)
    time.sleep(float(os.environ.get("FAKE_SCHEDULER_START_DELAY_S", "0")))
    if rank != 0:  # other ranks just idle until the parent stops them
        while True:
            if heartbeat is not None:
                heartbeat.value = time.monotonic()
            time.sleep(0.5)
    step_s = float(os.environ.get("FAKE_SCHEDULER_STEP_S", "0.005"))
    eos = set(ModelConfig.from_pretrained(engine_config.model).eos_token_ids)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(endpoints.scheduler)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(endpoints.detokenizer)
    decoder = msgspec.msgpack.Decoder(SchedulerInput)
    encoder = msgspec.msgpack.Encoder()
    ack_queue.put(f"scheduler ready (fake, tp_size={engine_config.tp_size})")
    running: dict[int, _Running] = {}
    page = engine_config.page_size
    while True:
        if heartbeat is not None:
            heartbeat.value = time.monotonic()
        timeout = int(step_s * 1000) if running else 500
        outputs: list[TokenOutput] = []
        if inbox.poll(timeout):
            while True:
                try:
                    msg = decoder.decode(inbox.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, Shutdown):
                    ctx.destroy(linger=0)
                    return
                if isinstance(msg, GenerateRequest):
                    running[msg.rid] = _Running(msg)
                elif isinstance(msg, AbortRequest):
                    if running.pop(msg.rid, None) is not None:
                        outputs.append(TokenOutput(rid=msg.rid, token_ids=[], finish_reason="abort"))
                elif isinstance(msg, FlushCache):
                    pass
        for rid in sorted(running):
            r = running[rid]
            ids = r.req.input_ids
            token = ids[r.generated % len(ids)]
            r.generated += 1
            params = r.req.params
            finish = None
            if not params.ignore_eos and (token in eos or token in (params.stop_token_ids or [])):
                finish = "stop"
            elif r.generated >= params.max_tokens:
                finish = "length"
            outputs.append(
                TokenOutput(
                    rid=rid,
                    token_ids=[token],
                    finish_reason=finish,
                    prompt_tokens=len(ids) if r.generated == 1 else 0,
                )
            )
            if finish is not None:
                del running[rid]
        used = sum(math.ceil((len(r.req.input_ids) + r.generated) / page) for r in running.values())
        stats = SchedulerStats(running=len(running), waiting=0, kv_pages_used=used, kv_pages_total=KV_PAGES_TOTAL)
        outbox.send(encoder.encode(BatchTokenOutput(outputs=outputs, stats=stats)))
