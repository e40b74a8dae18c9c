"""Multi-node tensor parallelism, two nodes simulated as two launches on this host
(``--device cpu --nnodes 2``): greedy outputs equal a one-process TP 1 run and transformers; a
clean stop ends both nodes with 0; a killed node stops every process non-zero within 30 s, naming
it; a node that never comes is named too; a connection from outside the job gets nothing."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist
import zmq
from nodes_process import TOKEN, TwoNodes, greedy, two_nodes

from tpserve.distributed.control import CurveKeys
from tpserve.scheduler.io import BROADCAST_KEY

PROMPTS = [[5, 17, 42, 9, 100, 3], [7, 7, 7, 200, 31], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
MAX_TOKENS = 12
STOP_WITHIN_S = 30
STARTUP_S = 120


@pytest.fixture(scope="module")
def expected(qwen3_dir) -> list[str]:
    """What a one-process TP 1 run answers, checked against transformers."""
    from reference import hf_greedy
    from tpserve import LLM, SamplingParams
    from tpserve.tokenizer.loader import load_tokenizer

    tokenizer = load_tokenizer(qwen3_dir)
    with LLM(qwen3_dir, device="cpu") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(qwen3_dir, prompt, MAX_TOKENS)
    return [tokenizer.decode(out.token_ids, skip_special_tokens=True) for out in outs]


def test_tp2_one_rank_a_node_matches_tp1_and_stops_cleanly(qwen3_dir, expected):
    with two_nodes(qwen3_dir, 2, extra=["--served-model-name", "m"]) as job:
        url = job[0].wait_ready()
        assert [greedy(url, p, MAX_TOKENS) for p in PROMPTS] == expected
        _check_outsiders_refused(job, url)
        assert "listening on" not in job[1].log  # node 1 runs no HTTP server
        job[0].proc.send_signal(signal.SIGTERM)
        assert job.wait_exits(STOP_WITHIN_S) == {0: 0, 1: 0}, job[0].log + job[1].log
        assert "node 0 ended the job" in job[1].log


def test_tp4_two_ranks_a_node_matches_tp1_and_a_killed_node_stops_the_job(qwen3_dir, expected):
    with two_nodes(qwen3_dir, 4, extra=["--served-model-name", "m"]) as job:
        url = job[0].wait_ready()
        assert [greedy(url, p, MAX_TOKENS) for p in PROMPTS] == expected
        # mid-run: a long request is being decoded when node 1's ranks die
        threading.Thread(target=_ignore_errors, args=(greedy, url, PROMPTS[0], 5000), daemon=True).start()
        time.sleep(1.0)
        ranks = [p for p in job[1].descendants() if "spawn_main" in " ".join(_cmdline(p))]
        assert len(ranks) == 2, job[1].log
        started = time.monotonic()
        for p in ranks:
            p.kill()
        codes = job.wait_exits(STOP_WITHIN_S)
        elapsed = time.monotonic() - started
        assert codes[0] not in (None, 0) and codes[1] not in (None, 0), (codes, job[0].log, job[1].log)
        assert elapsed < STOP_WITHIN_S
        assert "rank 2 (node 1), rank 3 (node 1) are dead or unreachable" in job[0].log, job[0].log
        assert "node 1: tpserve-scheduler-tp" in job[1].log and "stopping this node" in job[1].log, job[1].log


def test_a_dead_node_0_stops_node_1(qwen3_dir):
    with two_nodes(qwen3_dir, 2) as job:
        job[0].wait_ready()
        for p in job[0].descendants():
            p.kill()
        job[0].proc.kill()
        started = time.monotonic()
        codes = job.wait_exits(STOP_WITHIN_S)
        assert codes[1] not in (None, 0) and time.monotonic() - started < STOP_WITHIN_S, (codes, job[1].log)
        assert "node 0 (rank 0, which holds the rendezvous store" in job[1].log, job[1].log


def test_a_node_without_node_0_stops_naming_it(qwen3_dir):
    """(A rank 0 that misses a node names it too: test_nodes_unit.py, in-process.)"""
    with two_nodes(qwen3_dir, 2, extra=["--dist-timeout", "3"], nodes=(1,)) as alone:
        # the process's start-up (torch's import) comes on top of the 3 s
        assert alone.wait_exits(STARTUP_S)[1] not in (None, 0), alone[1].log
        assert "rank 1 (node 1): could not reach node 0 (rank 0's rendezvous store)" in alone[1].log, alone[1].log


def _check_outsiders_refused(job: TwoNodes, url: str) -> None:
    """Outsiders learn the broadcast's endpoint (the store is open) but get no message: without
    the token's keys their CURVE handshake fails; with the server's public key but a client key
    of their own the ZAP check refuses them."""
    store = dist.TCPStore("127.0.0.1", job.port, None, False, timeout=timedelta(seconds=10), wait_for_workers=False)
    endpoint = store.get(BROADCAST_KEY).decode()
    assert endpoint.startswith("tcp://127.0.0.1:")
    ctx = zmq.Context()
    try:
        plain = ctx.socket(zmq.SUB)
        wrong = ctx.socket(zmq.SUB)
        keys = CurveKeys.from_token("some-other-token-000000")
        wrong.curve_serverkey, wrong.curve_publickey, wrong.curve_secretkey = (
            keys.server_public, keys.client_public, keys.client_secret)
        leaked = ctx.socket(zmq.SUB)
        own_public, own_secret = zmq.curve_keypair()
        leaked.curve_serverkey = CurveKeys.from_token(TOKEN).server_public
        leaked.curve_publickey, leaked.curve_secretkey = own_public, own_secret
        outsiders = [plain, wrong, leaked]
        for sock in outsiders:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(endpoint)
        time.sleep(0.5)
        greedy(url, PROMPTS[1], 4)
        assert all(sock.poll(500) == 0 for sock in outsiders)
        assert "refused a control-plane connection" in job[0].log
    finally:
        ctx.destroy(linger=0)


def _ignore_errors(fn, *args) -> None:
    with contextlib.suppress(Exception):
        fn(*args)


def _cmdline(p: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return p.cmdline()
    return []
