"""``tpserve --shell`` in a pseudo-terminal (pexpect), over the fake scheduler: its answers
echo the prompt's first message, one token per step, and stop at the first <|im_end|>."""

from __future__ import annotations

import io
import os
import sys

import pexpect
import psutil
import pytest
from server_process import FAKE_SCHEDULER, HERE, wait_gone
from tpserve.launch.shell import Shell
from tpserve.message.frontend import ApiOutput

PROMPT = ">>> "


@pytest.fixture()
def shell(qwen3_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
               FAKE_SCHEDULER_STEP_S="0.02")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "tpserve", "--shell", "--model", qwen3_dir, "--scheduler-entry", FAKE_SCHEDULER,
         "--log-level", "warning"],
        env=env, encoding="utf-8", timeout=60, dimensions=(50, 200),
    )
    try:
        yield child
    finally:
        if child.isalive():
            child.terminate(force=True)


def test_shell_session(shell):
    shell.expect_exact(PROMPT, timeout=120)
    children = psutil.Process(shell.pid).children(recursive=True)
    assert children

    shell.sendline("hello 你好")
    shell.expect_exact("user\r\nhello 你好\r\n")  # the streamed (echoed) answer
    shell.expect_exact(PROMPT)
    shell.sendline("second turn")
    shell.expect_exact(PROMPT)
    shell.sendline("/history")
    shell.expect_exact("(4 messages)")
    shell.expect_exact("[user] second turn")
    shell.expect_exact(PROMPT)

    # Ctrl-C stops a long answer and returns to the prompt; the server keeps going
    shell.sendline("/reset")
    shell.expect_exact("(conversation cleared)")
    shell.expect_exact(PROMPT)
    shell.sendline("long " * 300)
    shell.expect_exact("user\r\nlong long long")  # the answer is streaming (not the typed echo)
    shell.sendintr()
    shell.expect_exact("(stopped)")
    shell.expect_exact(PROMPT)
    shell.sendline("/reset")
    shell.expect_exact(PROMPT)
    shell.sendline("/history")
    shell.expect_exact("(0 messages)")
    shell.expect_exact(PROMPT)
    shell.sendline("again")
    shell.expect_exact("user\r\nagain\r\n")
    shell.expect_exact(PROMPT)

    # Ctrl-C at the prompt does not quit; Ctrl-D does, cleanly
    shell.sendintr()
    shell.expect_exact(PROMPT)
    shell.sendeof()
    shell.expect(pexpect.EOF)
    shell.close()
    assert shell.exitstatus == 0
    assert wait_gone(children, timeout=10) == []


class FakeClient:
    """ShellClient stand-in: each answer is "answer N" in two outputs."""

    def __init__(self) -> None:
        self.submitted: list[list[dict]] = []

    def submit(self, messages, params) -> int:
        self.submitted.append(messages)
        self.pending = [
            ApiOutput(rid=len(self.submitted), text="answer ", new_tokens=1, completion_tokens=1, prompt_tokens=1),
            ApiOutput(rid=len(self.submitted), text=f"{len(self.submitted)}", new_tokens=1, completion_tokens=2,
                          prompt_tokens=1, finish_reason="stop"),
        ]
        return len(self.submitted)

    def poll(self, rid, timeout_ms):
        events, self.pending = self.pending, []
        return events

    def abort(self, rid) -> None:
        pass


def run_shell_lines(monkeypatch, lines):
    feed = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    client, out = FakeClient(), io.StringIO()
    shell = Shell(client, lambda: None, out)  # type: ignore[arg-type]
    shell.run()
    return shell, client, out.getvalue()


def test_conversation_is_kept_and_reset(monkeypatch):
    shell, client, out = run_shell_lines(monkeypatch, ["hi", "  ", "more", "/reset", "fresh", "/exit", "never"])
    assert "answer 1" in out and "answer 2" in out and "(conversation cleared)" in out
    assert client.submitted[1] == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "answer 1"},
        {"role": "user", "content": "more"},
    ]
    assert client.submitted[2] == [{"role": "user", "content": "fresh"}]
    assert len(client.submitted) == 3  # nothing after /exit
    assert shell.history[-1] == {"role": "assistant", "content": "answer 3"}
