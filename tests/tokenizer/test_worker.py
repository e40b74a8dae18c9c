"""The tokenizer worker process's loop: a long prompt does not hold up the short ones behind it."""

from __future__ import annotations

import queue
import shutil
import threading
import time

import msgspec
import zmq

from tpserve.message import SchedulerInput, Shutdown
from tpserve.message.endpoints import Endpoints
from tpserve.message.frontend import TokenizeRequest
from tpserve.message.transport import encode, open_socket
from tpserve.sampling_params import SamplingParams
from tpserve.tokenizer.prepare import PromptLimits
from tpserve.tokenizer.worker import TokenizerConfig, run_tokenizer


def test_short_requests_overtake_a_long_one(qwen3_dir):
    endpoints = Endpoints.create()
    ctx = zmq.Context()
    try:
        to_worker = open_socket(ctx, zmq.PUSH, endpoints.tokenizer, bind=True)
        scheduler = open_socket(ctx, zmq.PULL, endpoints.scheduler, bind=True)
        detokenizer = open_socket(ctx, zmq.PULL, endpoints.detokenizer, bind=True)
        api = open_socket(ctx, zmq.PULL, endpoints.api, bind=True)
        acks: queue.Queue = queue.Queue()
        config = TokenizerConfig(qwen3_dir, PromptLimits(context_len=10**7, vocab_size=10**6))
        worker = threading.Thread(target=run_tokenizer, args=(config, endpoints, acks, 0), daemon=True)
        worker.start()
        acks.get(timeout=60)
        params = SamplingParams(max_tokens=1)
        long_text = "The quick brown fox jumps over the lazy dog, said the clockmaker. " * 40_000  # 2.6 M chars
        to_worker.send(encode(TokenizeRequest(rid=1, params=params, text=long_text)))
        time.sleep(0.05)
        sent = time.monotonic()
        for rid in (2, 3, 4):
            to_worker.send(encode(TokenizeRequest(rid=rid, params=params, text="hello")))
        decoder = msgspec.msgpack.Decoder(SchedulerInput)
        order, arrival = [], {}
        while len(order) < 4 and scheduler.poll(60_000):
            msg = decoder.decode(scheduler.recv())
            order.append(msg.rid)
            arrival[msg.rid] = time.monotonic() - sent
        assert order[:3] == [2, 3, 4] and order[3] == 1, order
        assert max(arrival[r] for r in (2, 3, 4)) < 0.5, arrival
        assert arrival[1] > max(arrival[r] for r in (2, 3, 4))
        to_worker.send(encode(Shutdown()))
        worker.join(10)
        assert not worker.is_alive()
        del detokenizer, api
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(endpoints.directory, ignore_errors=True)


def test_the_workers_render_with_the_servers_default_template_kwargs(qwen3_dir):
    """--default-chat-template-kwargs reaches each worker's preparer through its TokenizerConfig."""
    from tpserve.tokenizer.worker import _preparer

    limits = PromptLimits(context_len=10**4, vocab_size=10**6)
    chat = TokenizeRequest(rid=1, params=SamplingParams(max_tokens=1), messages=[{"role": "user", "content": "hi"}])
    plain = _preparer(TokenizerConfig(qwen3_dir, limits)).render_chat(chat)
    off = _preparer(TokenizerConfig(qwen3_dir, limits, default_template_kwargs={"enable_thinking": False}))
    assert off.render_chat(chat) == plain + "<think>\n\n</think>\n\n"
