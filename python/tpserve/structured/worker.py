"""The matchers' work of constrained steps on a thread of its own, off the host's critical path.

A constrained step's sampling needs its grammar masks, and they need the previous step's tokens
accepted by the matchers first; its forward needs neither. So when the scheduler starts step i+1
it submits one job (wait for step i's tokens, accept them, fill step i+1's masks) and enqueues
step i+1's forward; it joins the job in its next step, after preparing step i+2, right before
enqueueing step i+1's sampling. xgrammar releases the GIL inside its calls (and torch while it
waits for the device), so the job runs while the main thread plans and launches.

The job's Python between those calls needs the GIL, so the job makes few calls: termination is
tracked here rather than asked of each matcher, the accept's result is read without releasing the
GIL per row (``MaskFiller.accept``), and a fill uses xgrammar's own threads only for large batches
(it starts them afresh on every call).

Only the job touches the matchers (the main thread never reads their state), and jobs run one at
a time in submission order, so a request that finishes or is aborted while a job holds its
matcher leaves it to that job alone. Which rows get masks is decided from the matchers' own state
(a terminated matcher gets none), never from timing, so every TP rank fills the same masks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tpserve.structured.grammar import MaskFiller, RequestGrammar
from tpserve.structured.mask import unpack_bitmask

logger = logging.getLogger(__name__)


@dataclass
class SampledRows:
    """A sampled constrained step whose tokens the matchers have not yet taken."""

    tokens: Callable[[], list[int]]  # the step's tokens by row (waits for the device)
    rows: list[tuple[int, int, RequestGrammar]]  # (row, request id, its grammar)


Masks = torch.Tensor  # [B, ceil(V / 32)] int32 host bitmask, every row (unconstrained rows allow all)


@dataclass
class StepMasks:
    """A mask job's result. A dead-end row's grammar allowed no token at all (it accepts no output, e.g. ``root ::=
    root``, or none from where it is): that request ends with an error rather than with a token the grammar forbids."""

    masks: Masks | None  # None when every grammar of the step has terminated
    dead_rows: list[int]


class MaskWorker:
    """Runs mask jobs in order on one thread (inline when ``threaded`` is False: the same work
    at the same points, for comparison). ``stop_token_ids``: the tokens that end a grammar.
    ``device``: the rank's GPU, made the thread's current device, so that waiting for the tokens
    there never sets up a CUDA context on another GPU (the default device of a new thread)."""

    def __init__(
        self, filler: MaskFiller, stop_token_ids: list[int], threaded: bool = True, device: torch.device | None = None
    ) -> None:
        self.filler = filler
        self._stop = frozenset(stop_token_ids)
        self._pool = None
        if threaded:
            on_gpu = device is not None and device.type == "cuda"
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpserve-masks",
                                            initializer=torch.cuda.set_device if on_gpu else None,
                                            initargs=(device,) if on_gpu else ())
        self._unaccepted: list[SampledRows] = []

    def sampled(self, step: SampledRows) -> None:
        """A constrained step was sampled: the next job gives its tokens to the matchers first."""
        self._unaccepted.append(step)

    def submit(self, fills: list[tuple[int, RequestGrammar]], batch_size: int) -> Future[StepMasks]:
        """Accept every sampled step's tokens, then fill the masks of ``fills`` ((row, grammar)
        of a batch of ``batch_size``). The scheduler waits for the job (``result()``) before it
        samples that step."""
        accepts, self._unaccepted = self._unaccepted, []
        if self._pool is None:
            future: Future[StepMasks] = Future()
            try:
                future.set_result(self._run(accepts, fills, batch_size))
            except Exception as e:
                future.set_exception(e)
            return future
        return self._pool.submit(self._run, accepts, fills, batch_size)

    def _run(self, accepts: list[SampledRows], fills: list[tuple[int, RequestGrammar]], batch_size: int) -> StepMasks:
        for step in accepts:
            tokens = step.tokens()
            live = [(rid, grammar, tokens[row]) for row, rid, grammar in step.rows
                    if not grammar.terminated and not grammar.dead_end]
            if not live:
                continue
            accepted = self.filler.accept([g.matcher for _, g, _ in live], [token for _, _, token in live])
            for (rid, grammar, token), ok in zip(live, accepted):
                if not ok:
                    logger.warning("request %d: its grammar rejected token %d", rid, token)
                    continue
                grammar.accepted += 1
                if token in self._stop:
                    grammar.terminated = True
        live_fills = [(row, grammar) for row, grammar in fills if not grammar.terminated and not grammar.dead_end]
        if not live_fills:
            return StepMasks(None, [])
        rows = [row for row, _ in live_fills]
        masks = self.filler.fill([grammar.matcher for _, grammar in live_fills], rows, batch_size)
        allows_some = masks[rows].any(dim=1).tolist()
        dead_rows = []
        for (row, grammar), ok in zip(live_fills, allows_some):
            if ok and grammar.bans_stops and not _allows_other_than(masks[row], grammar.early_stops):
                ok, grammar.only_stops = False, True
            if not ok:
                grammar.dead_end = True
                dead_rows.append(row)
                masks[row] = -1  # sampled unmasked (an all-masked row has no distribution); the token is dropped
        return StepMasks(masks, dead_rows)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _allows_other_than(mask_row: torch.Tensor, tokens: list[int]) -> bool:
    """Whether a packed bitmask row allows a token not in ``tokens``."""
    allowed = unpack_bitmask(mask_row[None], 32 * mask_row.numel())[0]
    allowed[[t for t in tokens if t < allowed.numel()]] = False
    return bool(allowed.any())
