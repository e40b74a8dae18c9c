"""``tpserve --shell`` in a pseudo-terminal (pexpect), over the fake scheduler: its answers
echo the prompt's first message, one token per step, and stop at the first <|im_end|>."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys

import pexpect
import psutil
import pytest
from server_process import FAKE_TPSERVE, HERE, wait_gone
from tpserve.launch.shell import Shell, ShellSettings
from tpserve.message.frontend import ApiOutput

PROMPT = ">>> "


@pytest.fixture()
def shell(qwen3_dir, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
               FAKE_SCHEDULER_STEP_S="0.02", TPSERVE_CACHE=str(tmp_path))
    child = pexpect.spawn(
        sys.executable,
        [FAKE_TPSERVE, "--shell", "--model", qwen3_dir, "--log-level", "info"],
        env=env, encoding="utf-8", timeout=60, dimensions=(50, 200),
    )
    try:
        yield child
    finally:
        if child.isalive():
            child.terminate(force=True)


def say(shell: pexpect.spawn, line: str, *expected: str) -> None:
    """Type ``line``, expect each of ``expected`` in turn, then the next prompt."""
    shell.sendline(line)
    for text in expected:
        shell.expect_exact(text)
    shell.expect_exact(PROMPT)


def test_shell_session(shell, tmp_path):
    shell.expect(r"logs: (\S+\.log)", timeout=120)
    log_file = shell.match.group(1)
    assert log_file.startswith(str(tmp_path))
    shell.expect_exact(PROMPT, timeout=120)
    children = psutil.Process(shell.pid).children(recursive=True)
    assert children

    say(shell, "hello 你好", "user\r\nhello 你好\r\n")  # the streamed (echoed) answer
    say(shell, "second turn")
    say(shell, "/history", "(4 messages)", "[user] second turn")

    # Ctrl-C stops a long answer and returns to the prompt; the server keeps going
    say(shell, "/reset", "(conversation cleared)")
    shell.sendline("long " * 300)
    shell.expect_exact("user\r\nlong long long")  # the answer is streaming (not the typed echo)
    shell.sendintr()
    shell.expect_exact("(stopped)")
    shell.expect_exact(PROMPT)
    say(shell, "/reset")
    say(shell, "/history", "(0 messages)")
    say(shell, "again", "user\r\nagain\r\n")

    # commands never reach the model; settings change the next answers
    say(shell, "/foo", "unknown command '/foo'", "/set temperature T")
    say(shell, "/system Be brief.", "(system prompt set; new conversation)")
    shell.sendline("question")
    shell.expect_exact("system\r\nBe brief.")  # the fake model echoes the prompt's first message
    shell.expect(r"\(\d+ tokens, [0-9.]+ tok/s\)")
    shell.expect_exact(PROMPT)
    say(shell, "/set max_tokens 3", "max_tokens 3")
    say(shell, "cut me short please", "(cut at max_tokens 3: /set max_tokens N for longer answers)")
    say(shell, "/think off", "(thinking off)")
    say(shell, "/settings", "thinking off")
    assert " INFO " not in shell.before  # log lines go to the file, never into the conversation

    # Ctrl-C at the prompt does not quit; Ctrl-D does, cleanly
    shell.sendintr()
    shell.expect_exact(PROMPT)
    shell.sendeof()
    shell.expect(pexpect.EOF)
    shell.close()
    assert shell.exitstatus == 0
    assert wait_gone(children, timeout=10) == []
    with open(log_file) as f:
        assert "scheduler ready" in f.read()  # the processes' INFO lines are in the file
    assert os.path.isfile(tmp_path / "shell_history")


@pytest.mark.parametrize("damage", ["{bad", '{"model": {"type": "BPE"}}'])
def test_damaged_tokenizer_is_an_error_on_the_terminal(qwen3_dir, tmp_path, damage):
    """Was tracebacks of the child processes and "tpserve-detokenizer exited (exit code 1)", the
    cause only in the shell's log file."""
    model_dir = shutil.copytree(qwen3_dir, tmp_path / "m")
    (model_dir / "tokenizer.json").write_text(damage)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
               TPSERVE_CACHE=str(tmp_path))
    proc = subprocess.run([sys.executable, FAKE_TPSERVE, "--shell", "--model", str(model_dir)], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"tpserve: error: cannot load the tokenizer in {model_dir}: "), error
    if damage == "{bad":
        assert f"{model_dir / 'tokenizer.json'} is not valid JSON" in error
    assert not (tmp_path / "logs").exists(), "no process was started"


class FakeClient:
    """ShellClient stand-in: each answer is "answer N" in two outputs."""

    def __init__(self) -> None:
        self.submitted: list[list[dict]] = []
        self.params: list = []
        self.template_kwargs: list = []

    def submit(self, messages, params, template_kwargs=None) -> int:
        self.submitted.append(messages)
        self.params.append(params)
        self.template_kwargs.append(template_kwargs)
        self.pending = [
            ApiOutput(rid=len(self.submitted), text="answer ", new_tokens=1, completion_tokens=1, prompt_tokens=1),
            ApiOutput(rid=len(self.submitted), text=f"{len(self.submitted)}", new_tokens=1, completion_tokens=2,
                          prompt_tokens=1, finish_reason="stop"),
        ]
        return len(self.submitted)

    def poll(self, timeout_ms):
        events, self.pending = self.pending, []
        return events

    def abort(self, rid) -> None:
        pass


def run_shell_lines(monkeypatch, lines, client=None, reasoning=False, **shell_kwargs):
    feed = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    client, out = client or FakeClient(), io.StringIO()
    shell = Shell(client, lambda: None, out, context_len=64, reasoning=reasoning, **shell_kwargs)  # type: ignore[arg-type]
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


def test_commands_set_the_next_requests(monkeypatch):
    lines = ["/set temperature 0", "/set max_tokens 7", "/think on", "/system Be brief.", "hi",
             "/set temperature hot", "/set max_tokens 0", "/set colour blue", "/unknown", "/help"]
    shell, client, out = run_shell_lines(monkeypatch, lines)
    assert len(client.submitted) == 1  # commands are never sent to the model
    assert client.submitted[0][0] == {"role": "system", "content": "Be brief."}
    assert client.params[0].temperature == 0 and client.params[0].max_tokens == 7
    assert client.template_kwargs[0] == {"enable_thinking": True}
    assert shell.history == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "answer 1"}]
    assert "bad value 'hot' for temperature" in out and "bad value '0' for max_tokens" in out
    assert "unknown setting 'colour'" in out and "unknown command '/unknown'" in out
    assert out.count("/think on|off") == 2  # the help, after the unknown command and for /help


def test_the_models_sampling_defaults_are_the_shells(monkeypatch):
    """--generation-config: the shell samples with the model's temperature, top_p and top_k, /set temperature over it."""
    _, client, out = run_shell_lines(monkeypatch, ["hi", "/set temperature 0.2", "again", "/set max_tokens 7"],
                                     sampling_defaults={"temperature": 0.6, "top_p": 0.95, "top_k": 20})
    first, second = client.params
    assert (first.temperature, first.top_p, first.top_k) == (0.6, 0.95, 20)
    assert (second.temperature, second.top_p, second.top_k) == (0.2, 0.95, 20)
    assert "(temperature 0.2, top_p 0.95, top_k 20, max_tokens 7" in out
    assert ShellSettings().params().temperature == 0.7  # a model without them: the shell's own 0.7


def test_a_max_tokens_no_request_can_carry_is_a_bad_value(monkeypatch):
    """It was taken, and the next message ended the shell with an OverflowError from the encoder."""
    shell, client, out = run_shell_lines(monkeypatch, [f"/set max_tokens {2**64}", "hi"])
    assert f"bad value '{2**64}' for max_tokens: max_tokens must be below 2**63" in out
    assert client.params[0].max_tokens == shell.settings.max_tokens != 2**64


def test_reasoning_is_labelled_and_kept_out_of_the_history(monkeypatch):
    class Thinking(FakeClient):
        def submit(self, messages, params, template_kwargs=None) -> int:
            rid = super().submit(messages, params, template_kwargs)
            self.pending = [
                ApiOutput(rid=rid, text="<think>hmm</th", new_tokens=3, completion_tokens=3, prompt_tokens=1),
                ApiOutput(rid=rid, text="ink>\n\nYes.", new_tokens=2, completion_tokens=5, prompt_tokens=1,
                          finish_reason="length"),
            ]
            return rid

    shell, _, text = run_shell_lines(monkeypatch, ["why?"], client=Thinking(), reasoning=True)
    assert "[thinking] hmm\nYes." in text
    assert "(cut at the context limit of 64 tokens" in text
    assert shell.history[-1] == {"role": "assistant", "content": "Yes."}


def test_control_characters_from_the_model_do_not_reach_the_terminal(monkeypatch):
    """Model text went to the terminal raw: an ESC starts a terminal command (a title, a colour, a cursor move)."""
    class Escaping(FakeClient):
        def submit(self, messages, params, template_kwargs=None) -> int:
            rid = super().submit(messages, params, template_kwargs)
            self.pending = [ApiOutput(rid=rid, text="a\x1b]0;pwned\x07b\tc\nd", new_tokens=1, completion_tokens=1,
                                      prompt_tokens=1, finish_reason="stop")]
            return rid

    shell, _, out = run_shell_lines(monkeypatch, ["hi"], client=Escaping())
    assert "a\ufffd]0;pwned\ufffdb\tc\nd" in out and "\x1b]" not in out and "\x07" not in out
    assert shell.history[-1]["content"] == "a\x1b]0;pwned\x07b\tc\nd"  # the conversation keeps it as generated


def test_undecodable_input_usage_lines_and_a_closed_pipe(monkeypatch):
    """Bytes that are not UTF-8 (read as lone surrogates) reach the model as U+FFFD: they failed the request's
    encoding and ended the shell. /think and /set say what they take; a reader gone from the pipe stops the shell
    quietly (was a BrokenPipeError traceback)."""
    bad = b"hi\xff\xfe there".decode("utf-8", "surrogateescape")
    lines = [bad, "/think", "/think maybe", "/set max_tokens abc", "/set temperature hot"]
    shell, client, out = run_shell_lines(monkeypatch, lines)
    assert client.submitted[0][-1] == {"role": "user", "content": "hi\ufffd\ufffd there"}
    assert out.count("usage: /think on|off") == 2
    assert "bad value 'abc' for max_tokens: must be a whole number or none" in out
    assert "bad value 'hot' for temperature: must be a number" in out

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError

    monkeypatch.setattr("builtins.input", lambda prompt="": "hi")
    with pytest.raises(SystemExit) as e:
        Shell(FakeClient(), lambda: None, ClosedPipe(), context_len=64).run()  # type: ignore[arg-type]
    assert e.value.code == 0


def test_transformers_warnings_go_to_the_log_file_not_the_terminal(tmp_path):
    log = tmp_path / "shell.log"
    code = ("import sys; from tpserve.launch.child import setup_logging; setup_logging('info', sys.argv[1]); "
            "from transformers.utils import logging; "
            "logging.get_logger('transformers.tokenization_utils_base').warning('Token indices sequence length')")
    done = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Token indices" not in done.stderr, done.stderr
    assert "WARNING" in log.read_text() and "Token indices sequence length" in log.read_text()


def test_the_models_max_new_tokens_is_the_shells_max_tokens():
    """generation_config's max_new_tokens (vLLM's max_tokens): the shell's until /set max_tokens."""
    settings = ShellSettings.for_model({"temperature": 0.6, "max_tokens": 32})
    assert (settings.params().max_tokens, settings.params().temperature) == (32, 0.6)
    assert "max_tokens 32" in settings.describe()
