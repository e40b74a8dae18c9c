"""Run ``python -m tpserve`` as a subprocess for end-to-end tests (port 0: no fixed ports)."""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import psutil

HERE = Path(__file__).resolve().parent
FAKE_TPSERVE = str(HERE / "fake_tpserve.py")  # tpserve over the fake scheduler
_URL = re.compile(r"listening on (https?://\S+)")


class ServerProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, fake_scheduler: bool = False) -> None:
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), full_env.get("PYTHONPATH")]))
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, *([FAKE_TPSERVE] if fake_scheduler else ["-m", "tpserve"]), "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
        )
        self.lines: list[str] = []
        self._url_seen = threading.Event()
        self.url: str | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = _URL.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._url_seen.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_url(self, timeout: float = 60) -> str:
        if not self._url_seen.wait(timeout):
            raise TimeoutError(f"no URL logged:\n{self.log}")
        return self.url  # type: ignore[return-value]

    def wait_ready(self, timeout: float = 180, verify: ssl.SSLContext | bool = True) -> str:
        """``verify``: what httpx checks an HTTPS server's certificate with (its CA's context)."""
        url = self.wait_url(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log}")
            try:
                if httpx.get(f"{url}/health", timeout=2, verify=verify).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready:\n{self.log}")

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise

    def kill_all(self) -> None:
        for p in self.descendants():
            p.kill()
        self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        """Nothing outlives the block; the log is printed (pytest shows it when the test fails)."""
        self.kill_all()
        print(self.log)


def running_server(args: list[str], env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A ready server for a module-scoped fixture (``yield from running_server([...])``), stopped after."""
    srv = ServerProcess(args, env)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def metrics(url: str) -> dict[str, float]:
    """The server's /metrics samples, each named as the text format writes it, labels included
    (``tpserve_kv_pages_used``, ``tpserve_requests_finished_total{finish_reason="abort"}``)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(tpserve_\S+) (\S+)$", text, re.M)}


ABORTED = 'tpserve_requests_finished_total{finish_reason="abort"}'


def aborts(url: str) -> float:
    return metrics(url).get(ABORTED, 0.0)


def metrics_after_an_abort(url: str, before: float) -> dict[str, float]:
    """The server's metrics once its abort count has passed ``before`` (or after ~10 s)."""
    for _ in range(100):
        now = metrics(url)
        if now.get(ABORTED, 0.0) > before:
            break
        time.sleep(0.1)
    return now


def wait_gone(procs: list[psutil.Process], timeout: float = 10) -> list[psutil.Process]:
    """The processes still alive after ``timeout`` (zombies count as gone)."""
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
