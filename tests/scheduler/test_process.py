"""Scheduler processes driven over their real ZMQ sockets, as the server drives them."""

from __future__ import annotations

import multiprocessing as mp
import shutil

import msgspec
import pytest
import zmq
from reference import hf_greedy
from tpserve.engine_config import EngineConfig
from tpserve.distributed.comm import local_init_addr
from tpserve.message import (
    AbortRequest,
    BatchTokenOutput,
    FlushCache,
    GenerateRequest,
    Shutdown,
)
from tpserve.message.endpoints import Endpoints
from tpserve.sampling_params import SamplingParams
from tpserve.scheduler.process import run_scheduler


class Ranks:
    def __init__(self, model_dir: str, tp_size: int, **kwargs) -> None:
        self.endpoints = Endpoints.create()
        ctx = mp.get_context("spawn")
        config = EngineConfig(model=model_dir, tp_size=tp_size, device="cpu", debug_check_invariants=True,
                              dist_init_addr=local_init_addr(), **kwargs)
        self.zmq = zmq.Context()
        self.detok = self.zmq.socket(zmq.PULL)
        self.detok.bind(self.endpoints.detokenizer)
        self.to_scheduler = self.zmq.socket(zmq.PUSH)
        self.to_scheduler.connect(self.endpoints.scheduler)
        acks = ctx.Queue()
        self.procs = [ctx.Process(target=run_scheduler, args=(config, r, self.endpoints, acks)) for r in range(tp_size)]
        for p in self.procs:
            p.start()
        assert "scheduler ready" in acks.get(timeout=120)
        self.decoder = msgspec.msgpack.Decoder(BatchTokenOutput)

    def send(self, msg) -> None:
        self.to_scheduler.send(msgspec.msgpack.encode(msg))

    def collect(self, rids: set[int], timeout_ms: int = 60000) -> dict[int, tuple[list[int], str, str | None]]:
        tokens: dict[int, list[int]] = {r: [] for r in rids}
        done: dict[int, tuple[list[int], str, str | None]] = {}
        self.last_stats = None
        while len(done) < len(rids):
            if not self.detok.poll(timeout_ms):
                raise TimeoutError(f"no output; finished {sorted(done)}")
            batch = self.decoder.decode(self.detok.recv())
            self.last_stats = batch.stats
            for out in batch.outputs:
                tokens[out.rid].extend(out.token_ids)
                if out.finish_reason:
                    done[out.rid] = (tokens[out.rid], out.finish_reason, out.error)
        return done

    def close(self) -> None:
        self.send(Shutdown())
        for p in self.procs:
            p.join(20)
        self.zmq.destroy(linger=0)
        shutil.rmtree(self.endpoints.directory, ignore_errors=True)
        assert all(p.exitcode == 0 for p in self.procs), [p.exitcode for p in self.procs]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_scheduler_ranks_serve_requests(qwen3_dir, tp_size):
    ranks = Ranks(qwen3_dir, tp_size, max_total_tokens=512, page_size=4)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, seed=0)
        prompts = {i: [10 + i, 20 + i, 30 + i, 40 + i] for i in range(6)}
        for rid, prompt in prompts.items():
            ranks.send(GenerateRequest(rid, prompt, greedy))
        done = ranks.collect(set(prompts))
        for rid, prompt in prompts.items():
            assert done[rid][0] == hf_greedy(qwen3_dir, prompt, 10)
            assert done[rid][1] == "length"
        assert ranks.last_stats.kv_pages_used == 0

        # A request the KV cache can never hold is rejected; an aborted one frees its pages.
        ranks.send(GenerateRequest(100, [1] * 600, SamplingParams(max_tokens=10, seed=1)))
        ranks.send(GenerateRequest(101, [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True, seed=1)))
        ranks.send(AbortRequest(101))
        done = ranks.collect({100, 101})
        assert done[100][1] == "error" and "KV cache" in done[100][2]
        assert done[101][1] == "abort"
        assert ranks.last_stats.kv_pages_used == 0
    finally:
        ranks.close()


def test_tp2_mixed_workload_small_pool_matches_cacheless_tp1(qwen3_dir):
    """Shared prefixes over a small pool at TP=2 (eviction, preemption, chunking; ranks checked
    to agree every step) give exactly the outputs of a cache-less TP=1 run; the pool ends free."""
    from test_prefix_cache import random_workload

    work = [(prompt, msgspec.structs.replace(params, max_tokens=20 + rid % 10)) for rid, (prompt, params) in enumerate(random_workload(60, seed=3))]
    results = {}
    for tp_size, kwargs in [(1, dict(cache="naive", max_total_tokens=4096, disable_overlap=True)),
                            (2, dict(cache="radix", max_total_tokens=160, chunked_prefill_size=16))]:
        ranks = Ranks(qwen3_dir, tp_size, page_size=4, **kwargs)
        try:
            for rid, (prompt, params) in enumerate(work):
                ranks.send(GenerateRequest(rid, prompt, msgspec.structs.replace(params, seed=rid)))
            results[tp_size] = ranks.collect(set(range(len(work))))
            stats = ranks.last_stats
            ranks.send(FlushCache())
            ranks.send(GenerateRequest(999, [1, 2, 3], SamplingParams(max_tokens=1, seed=0)))
            ranks.collect({999})
            after_flush = ranks.last_stats
        finally:
            ranks.close()
        if tp_size == 2:
            assert stats.preemptions_total > 0 and stats.evicted_pages_total > 0 and stats.cached_tokens_total > 0
            assert after_flush.kv_pages_used == 0
            assert after_flush.kv_pages_cached <= 1, "only request 999's own page may be cached"
    assert results[1] == results[2]
    assert all(reason == "length" for _, reason, _ in results[2].values())


def test_a_checkpoint_that_does_not_load_is_one_log_line_not_a_traceback(qwen3_dir, tmp_path, caplog):
    """The start-up checks cannot see every tensor's shape: the rank finds a bad one as it loads. It
    says which in one line and exits 1 (the server then reports start-up failed, with that line), instead of a
    traceback."""
    from safetensors.torch import load_file, save_file

    model_dir = shutil.copytree(qwen3_dir, tmp_path / "m")
    weights = load_file(model_dir / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"][:3].clone()
    save_file(weights, model_dir / "model.safetensors")
    from tpserve.launch.child import ChildCannotGoOn

    with pytest.raises(ChildCannotGoOn) as e:  # child_main exits 1 on it, no traceback, and tells the parent why
        run_scheduler(EngineConfig(model=str(model_dir), device="cpu"), 0, None, None)  # type: ignore[arg-type]
    line = ("tp rank 0 cannot start: checkpoint tensor 'model.norm.weight' of shape (3,) does not fit the model "
            "config.json describes: weight: expected shape (64,), got (3,)")
    assert str(e.value) == line
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [line]
