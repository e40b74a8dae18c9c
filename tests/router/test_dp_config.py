"""Data-parallel settings: the GPU count check, the flags, the per-replica endpoints."""

from __future__ import annotations

import shutil
import time

import pytest
import torch

from tpserve.config import ModelConfig
from tpserve.engine_config import EngineConfig, check_can_start
from tpserve.launch.args import parse_args
from tpserve.launch.backend import Backend
from tpserve.message.endpoints import Endpoints


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_more_replicas_than_gpus(qwen3_dir, two_gpus):
    model = ModelConfig.from_pretrained(qwen3_dir)
    with pytest.raises(ValueError, match="--dp-size 2 x --tp-size 2 needs 4 GPUs; 2 visible"):
        check_can_start(EngineConfig(model=qwen3_dir, device="cuda", tp_size=2, dp_size=2), model, cli=True)
    with pytest.raises(ValueError, match="dp_size=3 x tp_size=1 needs 3 GPUs; 2 visible"):
        check_can_start(EngineConfig(model=qwen3_dir, device="cuda", dp_size=3), model)
    check_can_start(EngineConfig(model=qwen3_dir, device="cuda", dp_size=2), model, cli=True)


def test_cli_error_is_one_line(qwen3_dir, two_gpus, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", qwen3_dir, "--device", "cuda", "--dp-size", "2", "--tp-size", "2", "--load-format", "dummy"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "tpserve: error: --dp-size 2 x --tp-size 2 needs 4 GPUs; 2 visible\n"


def test_flags(qwen3_dir, capsys):
    args = parse_args(["--model", qwen3_dir, "--device", "cpu", "--dp", "3", "--load-balance-method", "minimum_tokens"])
    assert args.engine.dp_size == 3 and args.engine.dp_rank == 0 and args.load_balance_method == "minimum_tokens"
    assert parse_args(["--model", qwen3_dir, "--device", "cpu"]).load_balance_method == "cache_aware"
    for argv, fragment in (
        (["--dp-size", "0"], "argument --dp-size/--data-parallel-size/--dp/-dp: must be >= 1"),
        (["--dp-size", "2", "--shell"], "--shell runs one replica: drop --dp-size"),
        (["--load-balance-method", "random"], "invalid choice: 'random'"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["--model", qwen3_dir, "--device", "cpu", *argv])
        assert fragment in capsys.readouterr().err


def test_engine_config_checks_the_replica_index(qwen3_dir):
    with pytest.raises(ValueError, match=r"dp_rank must be in \[0, dp_size 2\), got 2"):
        EngineConfig(model=qwen3_dir, dp_size=2, dp_rank=2)


def test_each_replica_has_its_own_sockets():
    one, two = Endpoints.create(), Endpoints.create(2)
    try:
        assert one.for_replica(0) == one and one.dp_size == 1
        a, b = two.for_replica(0), two.for_replica(1)
        assert two.dp_size == 2 and len({a.scheduler, b.scheduler, two.scheduler}) == 3
        assert a.rank_broadcast != b.rank_broadcast
        assert a.detokenizer == b.detokenizer == two.detokenizer, "one detokenizer for every replica"
    finally:
        shutil.rmtree(one.directory)
        shutil.rmtree(two.directory)


def test_health_names_the_stalled_rank_and_replica(qwen3_dir):
    backend = Backend(EngineConfig(model=qwen3_dir, device="cpu", tp_size=2, dp_size=2), "info")
    try:
        assert len(backend.heartbeats) == 4
        now = time.monotonic()
        for beat in backend.heartbeats.values():
            beat.value = now
        assert backend.stalled(60) is None
        backend.heartbeats["scheduler rank 1 of replica 1"].value = now - 100
        backend.heartbeats["scheduler rank 0 of replica 1"].value = now - 99  # held by rank 1 in a collective
        assert backend.stalled(60).startswith("scheduler rank 1 of replica 1 has made no progress for 10")
    finally:
        backend.shutdown()


def test_replicas_run_on_one_node(qwen3_dir):
    with pytest.raises(ValueError, match="data-parallel replicas run on one node"):
        EngineConfig(model=qwen3_dir, tp_size=2, nnodes=2, dist_init_addr="127.0.0.1:29500", dp_size=2)
