"""Reasoning separation: the text inside ``<think>...</think>`` goes to ``reasoning_content``,
the rest to ``content`` (``--reasoning-parser qwen3`` or ``deepseek_r1``); ``granite`` (IBM Granite 3.2+) splits at
the phrases its template asks for instead (``GraniteReasoningParser``).

A chat template may open the think block itself (the prompt then ends inside it, and the output
has no ``<think>``: DeepSeek-R1-0528, QwQ), or close an empty one (Qwen3 with
``enable_thinking: false``), so the parser starts in the state the prompt leaves it in
(``prompt_opens_reasoning``); a model that opens the block itself writes ``<think>`` first, where
the prompt has no block of its own. Both
parser names (qwen3, deepseek_r1) use the same ``<think>``/``</think>`` rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpserve.parsers.partial import partial_suffix_len

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1", "granite")


def prompt_opens_reasoning(prompt_text: str) -> bool | None:
    """True if the prompt ends inside an open think block, False if its last one is closed,
    None if it has none."""
    start, end = prompt_text.rfind(THINK_START), prompt_text.rfind(THINK_END)
    if start < 0 and end < 0:
        return None
    return start > end


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Feed output text chunks; each call returns the new reasoning and content text."""

    def __init__(self, in_reasoning: bool | None) -> None:
        """``in_reasoning``: the prompt's state (``prompt_opens_reasoning``). After a block the prompt closed
        (False) the output is all content; with no block in the prompt (None) the output may open one."""
        self._in_reasoning = bool(in_reasoning)
        self._seen_start = in_reasoning is not None
        self._buffer = ""  # held-back text that may be the start of a tag
        self._content_started = False
        self._closed_here = False  # the output closed a think block
        # In a block the prompt opened, a <think> the output starts with is that block's tag written again (vLLM drops
        # it too): markup, not reasoning. Decided at the output's first non-blank characters.
        self._may_reopen = in_reasoning is True

    @property
    def in_block(self) -> bool:
        """Inside the think block, or past its end before any content (the newlines after ``</think>``)."""
        return self._in_reasoning or (self._closed_here and not self._content_started)

    def feed(self, text: str, final: bool = False) -> Split:
        out = Split()
        self._buffer += text
        while self._buffer:
            if self._may_reopen:
                stripped = self._buffer.lstrip()
                if stripped.startswith(THINK_START):
                    self._buffer, self._may_reopen = stripped[len(THINK_START):], False
                    continue
                if not final and THINK_START.startswith(stripped):
                    break  # could still become "<think>"
                self._may_reopen = False
            if self._in_reasoning:
                i = self._buffer.find(THINK_END)
                if i >= 0:
                    out.reasoning += self._buffer[:i]
                    self._buffer = self._buffer[i + len(THINK_END):]
                    self._in_reasoning, self._closed_here = False, True
                    continue
                keep = 0 if final else partial_suffix_len(self._buffer, (THINK_END,))
                out.reasoning += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            if not self._seen_start and not self._content_started:
                stripped = self._buffer.lstrip()
                if stripped.startswith(THINK_START):
                    self._buffer = stripped[len(THINK_START):]
                    self._in_reasoning = self._seen_start = True
                    continue
                if not final and THINK_START.startswith(stripped):
                    break  # could still become "<think>"
            text_out = self._buffer
            if not self._content_started and self._closed_here:
                text_out = text_out.lstrip("\n")  # the newlines after the output's </think> (not an answer's own)
                if not text_out and not final:
                    self._buffer = ""
                    break
            self._content_started = self._content_started or bool(text_out)
            out.content += text_out
            self._buffer = ""
        return out



# Granite's phrases, as vLLM's granite parser matches them ("Here's" too: some quantized Granites write it)
GRANITE_THINK_STARTS = ("Here is my thought process:", "Here's my thought process:")
GRANITE_RESPONSE_STARTS = ("Here is my response:", "Here's my response:")


class GraniteReasoningParser:
    """``granite`` (Granite 3.2+ with ``thinking`` on): ``Here is my thought process:`` opens the reasoning and ``Here
    is my response:`` ends it, the rest being content (either phrase with "Here's", as vLLM's). Output that does not
    start with the first phrase (blanks aside) is all content. The phrases are dropped, the text around them kept as
    written (the newlines after them too, as vLLM's). A phrase's first characters are held back until the text shows
    whether they are one, however the output is cut into pieces. The output ending before the second phrase leaves
    its thoughts in reasoning (vLLM: so streamed; whole, it returns such output as content, phrase and all)."""

    def __init__(self, in_reasoning: bool | None = None) -> None:
        """``in_reasoning``: the prompt's think-block state, which Granite's prompts have no part in (ignored)."""
        self._state = "start"  # "start": before the output shows whether it reasons; "reasoning"; "content"
        self._buffer = ""  # held-back text: the output's start, or a tail that may begin the response phrase
        self._closed_here = False  # the response phrase was read
        self._content_started = False

    @property
    def in_block(self) -> bool:
        """Inside the reasoning, or just past the response phrase before any content."""
        return self._state == "reasoning" or (self._closed_here and not self._content_started)

    def feed(self, text: str, final: bool = False) -> Split:
        out = Split()
        self._buffer += text
        if self._state == "start":
            head = self._buffer.lstrip()
            start = next((p for p in GRANITE_THINK_STARTS if head.startswith(p)), None)
            if start is not None:
                self._state, self._buffer = "reasoning", head[len(start):]
            elif not final and (not head or any(p.startswith(head) for p in GRANITE_THINK_STARTS)):
                return out  # could still become the phrase
            else:
                self._state = "content"
        if self._state == "reasoning":
            ends = [(i, p) for p in GRANITE_RESPONSE_STARTS if (i := self._buffer.find(p)) >= 0]
            if not ends:
                keep = 0 if final else partial_suffix_len(self._buffer, GRANITE_RESPONSE_STARTS)
                out.reasoning = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return out
            i, phrase = min(ends)
            out.reasoning, self._buffer = self._buffer[:i], self._buffer[i + len(phrase):]
            self._state, self._closed_here = "content", True
        out.content, self._buffer = self._buffer, ""
        self._content_started = self._content_started or bool(out.content)
        return out


def create_reasoning_parser(name: str | None, in_reasoning: bool | None) -> ReasoningParser | GraniteReasoningParser:
    """The ``--reasoning-parser`` named ``name`` (None: the ``<think>`` one), starting in the prompt's state."""
    if name == "granite":
        return GraniteReasoningParser(in_reasoning)
    if name in (None, "qwen3", "deepseek_r1"):
        return ReasoningParser(in_reasoning)
    raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(REASONING_PARSERS)}")
