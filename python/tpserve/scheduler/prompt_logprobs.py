"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``): which of a step's tokens need logits
rows of their own, storing what comes back by prompt position, and handing it out with the first token.

Such a request takes no cached prefix until its first token (``Request.wants_prompt_logprobs``), so every
prompt position is computed; a prompt computed again after a preemption overwrites its entries.
"""

from __future__ import annotations

from tpserve.engine.engine import LaunchedStep
from tpserve.forward import SequenceInput
from tpserve.message import TokenOutput
from tpserve.scheduler.request import Request


def plan_rows(scheduled: list[tuple[Request, int]], seqs: list[SequenceInput]) -> tuple[list[int], list[int], int]:
    """Set each sequence's ``extra_logits``: the tokens of its chunk whose next prompt token's
    log-probability its request asks for. Returns their count per row, their target tokens and the
    most alternatives any of them asks for."""
    counts, targets, top = [], [], 0
    for (req, n), seq in zip(scheduled, seqs):
        start = req.num_cached
        count = min(start + n, len(req.prompt_ids) - 1) - start  # the last prompt token predicts the first sample
        if not req.wants_prompt_logprobs or count <= 0:
            counts.append(0)
            continue
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * (len(req.prompt_ids) - 1)
        seq.extra_logits = count
        targets += req.prompt_ids[start + 1 : start + count + 1]
        top = max(top, req.params.prompt_logprobs)
        counts.append(count)
    return counts, targets, top


def record(entries: list[tuple[Request, int, int]], handle: LaunchedStep) -> None:
    """Store a step's results in their requests; ``entries``: (request, first position, count), in the
    order of the step's extra logits rows."""
    chosen, top_ids, top_values = handle.logprobs("prompt_")
    ranks = handle.ranks("prompt_")
    row = 0
    for req, start, count in entries:
        if req.prompt_logprobs is not None:  # None: it finished meanwhile
            n = req.params.prompt_logprobs
            for i, position in enumerate(range(start, start + count), start=row):
                req.prompt_logprobs[position] = (chosen[i], list(zip(top_ids[i][:n], top_values[i][:n])), ranks[i])
        row += count


def attach(out: TokenOutput, req: Request) -> None:
    """Put a request's prompt log-probabilities on its first output (and let them go)."""
    entries = req.prompt_logprobs or []  # a one-token prompt has none
    out.prompt_token_ids = req.prompt_ids
    out.prompt_logprobs = [e[0] for e in entries]
    out.prompt_top_logprobs = [e[1] for e in entries]
    out.prompt_ranks = [e[2] for e in entries]
    req.prompt_logprobs = None
