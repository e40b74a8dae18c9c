"""The multi-node pieces that need no second process: the layout, addresses, keys and the join's
deadline."""

from __future__ import annotations

import time

import pytest
import zmq

from tpserve.engine_config import EngineConfig
from tpserve.distributed.comm import free_port
from tpserve.distributed.control import CurveKeys
from tpserve.distributed.nodes import NodeFailure, NodeGroup, NodeLayout, split_addr
from tpserve.launch.ranks import start_ranks


def test_layout():
    layout = NodeLayout(nnodes=2, ranks_per_node=2)
    assert [layout.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [layout.local_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert list(layout.ranks_on(1)) == [2, 3] and layout.world_size == 4
    assert layout.names([2, 3]) == "rank 2 (node 1), rank 3 (node 1)"


def test_split_addr():
    assert split_addr("10.1.2.3:29500") == ("10.1.2.3", 29500)
    assert split_addr("tcp://node0.cluster:7") == ("node0.cluster", 7)
    assert split_addr("[::1]:5") == ("::1", 5)
    for bad in ("host", "host:port", ":5"):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            split_addr(bad)


def test_keys_come_from_the_token_only():
    a, b = CurveKeys.from_token("token-one-0123456789"), CurveKeys.from_token("token-one-0123456789")
    other = CurveKeys.from_token("token-two-0123456789")
    assert a == b and a.server_public != other.server_public and a.client_public != other.client_public
    assert zmq.curve_public(a.server_secret) == a.server_public and a.server_public != a.client_public


def test_engine_config_checks_the_layout(qwen3_dir):
    with pytest.raises(ValueError, match="tp_size 3 is not a multiple of nnodes 2"):
        EngineConfig(qwen3_dir, tp_size=3, nnodes=2, dist_init_addr="tcp://h:1")
    with pytest.raises(ValueError, match="nnodes 2 needs dist_init_addr"):
        EngineConfig(qwen3_dir, tp_size=2, nnodes=2)


def test_the_offline_llm_stays_on_one_node(qwen3_dir):
    with pytest.raises(ValueError, match="the offline LLM runs on one node"):
        start_ranks(EngineConfig(qwen3_dir, tp_size=2, nnodes=2, dist_init_addr="tcp://127.0.0.1:1"))


def test_a_missing_rank_is_named_when_the_join_times_out(qwen3_dir, capfd):
    config = EngineConfig(qwen3_dir, tp_size=2, nnodes=2, dist_init_addr=f"tcp://127.0.0.1:{free_port()}",
                          dist_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(NodeFailure, match=r"rank 0 \(node 0\): rank 1 \(node 1\) did not join within 1 s"):
        NodeGroup.join(0, config)
    with pytest.raises(NodeFailure, match=r"rank 1 \(node 1\): could not reach node 0"):
        NodeGroup.join(1, config)
    assert time.monotonic() - started < 10
    assert "frame #" not in capfd.readouterr().err  # no pages of torch's C++ stack frames before the error


def test_a_node_rank_given_twice_is_named(qwen3_dir):
    """Two nodes started with the same --node-rank both joined (the second overwrote the first's key); one formed
    the job, the other hung in the rendezvous until an unrelated Gloo error."""
    import threading

    config = EngineConfig(qwen3_dir, tp_size=2, nnodes=2, dist_init_addr=f"tcp://127.0.0.1:{free_port()}",
                          dist_timeout=30.0)
    groups: list[NodeGroup] = []
    node_0 = threading.Thread(target=lambda: groups.append(NodeGroup.join(0, config)))
    node_0.start()
    try:
        groups.append(NodeGroup.join(1, config))
        with pytest.raises(NodeFailure, match=r"rank 1 \(node 1\): another process joined as rank 1 \(node 1\) "
                                              r"already: is --node-rank 1 given to two nodes\?"):
            NodeGroup.join(1, config)
    finally:
        node_0.join()
        for group in groups:
            group.stop()


def test_peer_memory_all_reduce_does_not_span_nodes(qwen3_dir):
    with pytest.raises(ValueError, match="peer GPU memory, which does not span nodes"):
        EngineConfig(qwen3_dir, tp_size=2, nnodes=2, dist_init_addr="tcp://h:1", all_reduce="one_shot")
    assert EngineConfig(qwen3_dir, tp_size=2, nnodes=2, dist_init_addr="tcp://h:1", all_reduce="auto")


def test_a_rank_whose_store_closes_while_joining_gets_a_node_failure(qwen3_dir):
    """Node 0's ranks give up joining at about the same moment; rank 0, which holds the store, exits with its
    NodeFailure, and its node's other rank, still polling the store, got torch's DistNetworkError (a traceback, and
    the error the server's summary named instead of the missing node)."""
    import threading

    config = EngineConfig(qwen3_dir, tp_size=4, nnodes=2, dist_init_addr=f"tcp://127.0.0.1:{free_port()}",
                          dist_timeout=30.0)
    errors: list[BaseException] = []
    groups: list[NodeGroup] = []

    def join_rank_1() -> None:
        try:
            groups.append(NodeGroup.join(1, config))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    from tpserve.distributed.comm import rendezvous_store

    store = rendezvous_store(config.dist_init_addr, 0, 4, 30.0, wait_for_workers=False)  # rank 0's store
    rank_1 = threading.Thread(target=join_rank_1)
    rank_1.start()
    time.sleep(1.0)  # rank 1 is waiting for ranks 0, 2 and 3
    del store  # rank 0 gave up and exited: its store is gone
    rank_1.join(timeout=30)
    assert not rank_1.is_alive() and not groups
    assert len(errors) == 1 and isinstance(errors[0], NodeFailure), errors
    assert "rank 1 (node 0)" in str(errors[0]) and "closed before every rank joined" in str(errors[0])
