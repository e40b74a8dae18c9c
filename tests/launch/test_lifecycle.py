"""Process lifecycle: /health during start-up, clean stops on signals, the watchdog, start-up
failures, and no orphans on any path. Uses the fake scheduler (no model needed)."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import psutil
import pytest
from server_process import ServerProcess, wait_gone

from tpserve.launch.backend import first_failure


def start(qwen3_dir, env=None, extra=()):
    return ServerProcess(["--model", qwen3_dir, *extra], env=env, fake_scheduler=True)


def read_long_stream(url: str) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as resp:
            for _ in resp.iter_lines():
                pass
    except httpx.HTTPError:
        pass


def assert_listens_on_loopback_only(procs: list[psutil.Process]) -> None:
    """Every listening socket of the process tree (HTTP, the ranks' rendezvous store, Gloo) is on
    loopback when the user gave no other address."""
    listening = [
        (p.pid, c.laddr) for p in procs for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
    ]
    assert listening, "expected at least the HTTP listener"
    assert all(ipaddress.ip_address(addr.ip).is_loopback for _, addr in listening), listening


def pids_from_log(log: str) -> dict[str, int]:
    return {name: int(pid) for name, pid in re.findall(r"tpserve-([\w-]+) \(pid (\d+)\)", log)}


def ipc_dir_from_log(log: str) -> str:
    return re.search(r"ipc directory (\S+)", log).group(1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])  # SIGHUP: its terminal closed
def test_health_503_until_ready_then_signal_stops_everything(qwen3_dir, sig):
    if sig != signal.SIGINT:  # fake scheduler with a slow "model load"
        srv = start(qwen3_dir, env={"FAKE_SCHEDULER_START_DELAY_S": "2"}, extra=["--num-tokenizers", "2"])
        expected_children = 4  # scheduler, detokenizer, 2 tokenizers
    else:  # the real scheduler, two TP ranks on the CPU
        srv = ServerProcess(["--model", qwen3_dir, "--device", "cpu", "--tp", "2"])
        expected_children = 4  # 2 scheduler ranks, detokenizer, tokenizer
    with srv:
        url = srv.wait_url()
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        srv.wait_ready()
        body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 8
        children = srv.descendants()
        assert len(pids_from_log(srv.log)) == expected_children
        assert_listens_on_loopback_only([psutil.Process(srv.proc.pid), *children])
        ipc_dir = ipc_dir_from_log(srv.log)
        assert os.path.isdir(ipc_dir)
        streaming = threading.Thread(target=read_long_stream, args=(url,), daemon=True)
        streaming.start()  # a request still streaming must not hold the shut-down up
        time.sleep(0.5)
        t0 = time.monotonic()
        code = srv.stop(sig)
        assert time.monotonic() - t0 < 10
        assert code == 0, srv.log
        assert wait_gone(children, timeout=5) == []
        assert not os.path.exists(ipc_dir)
        assert "Traceback" not in srv.log


def test_watchdog_exits_when_a_child_dies(qwen3_dir):
    with start(qwen3_dir) as srv:
        srv.wait_ready()
        children = srv.descendants()
        os.kill(pids_from_log(srv.log)["detokenizer"], signal.SIGKILL)
        code = srv.proc.wait(15)
        assert code == 1
        assert "tpserve-detokenizer exited (killed by SIGKILL)" in srv.log
        assert wait_gone(children, timeout=5) == []
        assert not os.path.exists(ipc_dir_from_log(srv.log))


def test_the_watchdog_blames_the_killed_rank_not_the_peer_that_exited_after_it():
    """kill -9 of TP rank 1: rank 0's next collective fails (Gloo: connection reset by peer) and it
    exits with code 1 within milliseconds; rank 0 comes first in the list, yet the cause is rank 1."""
    procs = [SimpleNamespace(name="tpserve-scheduler-tp0", exitcode=1),
             SimpleNamespace(name="tpserve-scheduler-tp1", exitcode=-signal.SIGKILL),
             SimpleNamespace(name="tpserve-detokenizer", exitcode=None)]
    assert str(first_failure(procs)) == (
        "tpserve-scheduler-tp1 exited (killed by SIGKILL); also stopped: tpserve-scheduler-tp0 (exit code 1)")
    assert str(first_failure(procs[:1])) == "tpserve-scheduler-tp0 exited (exit code 1)"
    assert first_failure(procs[2:]) is None


def test_startup_failure_exits_nonzero(qwen3_dir):
    with start(qwen3_dir, env={"FAKE_SCHEDULER_FAIL": "1"}) as srv:
        code = srv.proc.wait(60)
        assert code == 1
        assert "start-up failed: tpserve-scheduler-tp0 exited (exit code 3)" in srv.log
        pids = pids_from_log(srv.log)
        assert pids and not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                for p in pids.values())


def test_children_exit_when_the_server_is_killed(qwen3_dir):
    with start(qwen3_dir) as srv:
        srv.wait_ready()
        children = srv.descendants()
        assert children
        srv.proc.kill()
        srv.proc.wait(5)
        assert wait_gone(children, timeout=5) == []


def bar_then_sigterm() -> None:
    """A child's work: a progress bar (weight loading's), then a SIGTERM of its own (systemd's stop signals every
    process of the service, not only the server)."""
    from tqdm import tqdm

    for _ in tqdm(range(2), disable=True):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def test_a_child_stopped_by_sigterm_leaves_no_semaphore(tmp_path):
    code = ("import multiprocessing, os; from tpserve.launch.child import child_main; "
            "multiprocessing.set_start_method('spawn');"  # as in the spawned children (with fork: no named semaphores)
            "child_main('test_lifecycle:bar_then_sigterm', (), os.getppid(), 'info')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM
    assert "leaked semaphore" not in done.stderr, done.stderr  # tqdm's default lock is a named semaphore


def test_a_child_ignores_ctrl_c_and_hangup_from_its_first_instruction():
    """A Ctrl-C (or a closed terminal) while the children were still importing torch ended each with a traceback:
    they ignored SIGINT only from child_main on. Started with the signals blocked, they ignore them throughout."""
    import multiprocessing

    from tpserve.launch.child import child_main, started_with_signals_blocked

    proc = multiprocessing.get_context("spawn").Process(target=child_main, args=("time:sleep", (3,), os.getpid(), "info"))
    with started_with_signals_blocked():
        proc.start()
    for sig in (signal.SIGINT, signal.SIGHUP):  # at once: the child is still starting its interpreter
        os.kill(proc.pid, sig)
    proc.join(60)
    assert proc.exitcode == 0
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the parent's mask is restored
