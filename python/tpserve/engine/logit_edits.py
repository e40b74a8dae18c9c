"""Per-request logit edits before sampling: logit bias, min-tokens and bad-word bans, then
repetition/frequency/presence penalties (vLLM's and transformers' order), allowed token ids; batched device work, the same on every TP rank (no float atomics).

A request with penalties gets a *slot* (chosen by the scheduler, alike on every rank) holding its
prompt's token set and output token counts on the device. Each sampled token is counted right
after sampling, on the device, so under overlap step i+1's penalties count step i's token before
the host has seen it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tpserve.engine.batch import upload
from tpserve.sampling_params import SamplingParams


# Repetition penalties are clamped to this range: beyond it float32 logits times the penalty could
# overflow to -inf (a seen token then looks masked) and a float32 penalty round to inf or 0 (0 / 0 is
# NaN); a logit times 1e30 is already far beyond every unpenalised one.
REPETITION_PENALTY_LIMIT = 1e30


def _finite_repetition(penalty: float) -> float:
    return min(max(penalty, 1 / REPETITION_PENALTY_LIMIT), REPETITION_PENALTY_LIMIT)


def allowed_mask(token_ids: Sequence[int], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[vocab_size] bool on ``device``: True at the ids below vocab_size (built once per request: a list as
    long as the vocabulary is a few milliseconds of host work, too much for every step)."""
    ids = torch.tensor([t for t in token_ids if t < vocab_size], dtype=torch.int64)
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[ids] = True
    return upload(mask, device)


@dataclass
class LogitEdits:
    """One step's edits as device tensors; ``*_rows`` index the step's batch rows."""

    penalty_rows: torch.Tensor | None = None  # [P] int64
    penalty_slots: torch.Tensor | None = None  # [P] int64
    penalties: torch.Tensor | None = None  # [3, P] float32: repetition, frequency, presence
    bias_index: torch.Tensor | None = None  # [2, N] int64 (row, token)
    bias_values: torch.Tensor | None = None  # [N] float32; -inf bans a token
    allow_rows: torch.Tensor | None = None  # [A] rows that may sample only some tokens
    allow_masks: torch.Tensor | None = None  # [A, V] bool: the tokens each of them may sample
    record_rows: torch.Tensor | None = None  # [R] rows whose sample counts toward their slot
    record_slots: torch.Tensor | None = None  # [R]
    # slots (re)assigned this step and their prompts
    init_slots: torch.Tensor | None = None  # [S]
    init_index: torch.Tensor | None = None  # [2, T] int64 (slot, token)
    max_slot: int = -1
    # rows whose allowed tokens are all banned this step (min_tokens, bad words): nothing to sample
    empty_rows: frozenset[int] = frozenset()

    @property
    def edits_logits(self) -> bool:
        return self.penalty_rows is not None or self.bias_index is not None or self.allow_rows is not None

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], slots: Sequence[int], steps: Sequence[int], sampled: Sequence[bool],
        new_slots: Sequence[tuple[int, list[int]]], eos_ids: Sequence[int], vocab_size: int, device: torch.device | str,
        outputs: Sequence[Sequence[int]] | None = None, allowed: Sequence[torch.Tensor | None] | None = None,
    ) -> LogitEdits | None:
        """None when no row edits its logits. ``slots[i]`` is row i's penalty slot (-1: none);
        ``new_slots`` are the slots first given out this step, with their requests' prompts; ``outputs[i]``:
        row i's output tokens so far (all of them, for its bad words of several tokens); ``allowed[i]``: row i's
        ``allowed_mask`` (made once per request by the caller; made here when not given)."""
        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        empty_rows = set()
        for i, p in enumerate(params):
            for token, value in (p.logit_bias or {}).items():
                if token < vocab_size:
                    bias_rows.append(i)
                    bias_tokens.append(token)
                    bias_values.append(value)
            banned = p.bad_word_bans(outputs[i] if outputs is not None else ())
            if steps[i] < p.min_tokens:
                banned += p.stops_before_min_tokens(eos_ids)
            banned = [t for t in banned if t < vocab_size]
            allowed_ids = p.allowed_token_ids
            if allowed_ids is not None and len(allowed_ids) <= len(banned) and set(allowed_ids).issubset(banned):
                empty_rows.add(i)
            bias_rows += [i] * len(banned)
            bias_tokens += banned
            bias_values += [float("-inf")] * len(banned)
        allow_rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        record = [i for i in pen_rows if sampled[i]]
        if not pen_rows and not bias_rows and not allow_rows and not new_slots:
            return None

        def ints(values: list[int] | list[list[int]]) -> torch.Tensor:
            return upload(torch.tensor(values, dtype=torch.int64), device)

        edits = cls(empty_rows=frozenset(empty_rows))
        if pen_rows:
            edits.penalty_rows = ints(pen_rows)
            edits.penalty_slots = ints([slots[i] for i in pen_rows])
            edits.penalties = upload(torch.tensor(
                [[_finite_repetition(params[i].repetition_penalty) for i in pen_rows],
                 [params[i].frequency_penalty for i in pen_rows],
                 [params[i].presence_penalty for i in pen_rows]],
                dtype=torch.float32,
            ), device)
        if record:
            edits.record_rows = ints(record)
            edits.record_slots = ints([slots[i] for i in record])
        if bias_rows:
            edits.bias_index = ints([bias_rows, bias_tokens])
            edits.bias_values = upload(torch.tensor(bias_values, dtype=torch.float32), device)
        if allow_rows:
            masks = [allowed[i] if allowed is not None and allowed[i] is not None
                     else allowed_mask(params[i].allowed_token_ids, vocab_size, device) for i in allow_rows]
            edits.allow_rows = ints(allow_rows)
            edits.allow_masks = torch.stack(masks)
        if new_slots:
            edits.init_slots = ints([s for s, _ in new_slots])
            edits.init_index = ints(
                [[s for s, ids in new_slots for _ in ids], [t for _, ids in new_slots for t in ids]]
            )
        edits.max_slot = max([s for s, _ in new_slots] + [slots[i] for i in pen_rows], default=-1)
        return edits


@dataclass
class PenaltyState:
    """Per-slot token history on the device: prompt token sets and output token counts."""

    vocab_size: int
    device: torch.device
    prompt_mask: torch.Tensor = field(init=False)  # [slots, V] bool
    counts: torch.Tensor = field(init=False)  # [slots, V] int32

    def __post_init__(self) -> None:
        self.prompt_mask = torch.zeros((0, self.vocab_size), dtype=torch.bool, device=self.device)
        self.counts = torch.zeros((0, self.vocab_size), dtype=torch.int32, device=self.device)

    def _reserve(self, slots: int) -> None:
        """Grow to at least ``slots`` rows (doubling), keeping the existing rows."""
        have = self.counts.shape[0]
        if slots <= have:
            return
        rows = max(slots, 2 * have, 4)
        mask = torch.zeros((rows, self.vocab_size), dtype=torch.bool, device=self.device)
        counts = torch.zeros((rows, self.vocab_size), dtype=torch.int32, device=self.device)
        mask[:have].copy_(self.prompt_mask)
        counts[:have].copy_(self.counts)
        self.prompt_mask, self.counts = mask, counts

    def apply(self, logits: torch.Tensor, edits: LogitEdits) -> torch.Tensor:
        """Edited float32 logits in a new tensor (the raw ones stay for log-probabilities and in the
        CUDA graph's output buffer); also (re)initialises the step's new slots."""
        self._reserve(edits.max_slot + 1)
        if edits.init_slots is not None:
            self.prompt_mask.index_fill_(0, edits.init_slots, False)
            self.counts.index_fill_(0, edits.init_slots, 0)
            self.prompt_mask.index_put_(tuple(edits.init_index), torch.ones((), dtype=torch.bool, device=self.device))
        if not edits.edits_logits:
            return logits
        out = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
        if edits.bias_index is not None:  # before the penalties, as transformers' sequence_bias and vLLM's logit_bias:
            # the repetition penalty scales the biased logit ((x + b) / r, not x / r + b)
            out.index_put_(tuple(edits.bias_index), edits.bias_values, accumulate=True)
        if edits.penalty_rows is not None:
            rows, slots = edits.penalty_rows, edits.penalty_slots
            sub = out.index_select(0, rows)
            counts = self.counts.index_select(0, slots).float()
            seen = self.prompt_mask.index_select(0, slots) | (counts > 0)
            repetition, frequency, presence = edits.penalties[:, :, None]
            penalized = torch.where(sub < 0, sub * repetition, sub / repetition)
            sub = torch.where(seen, penalized, sub)
            sub -= frequency * counts + presence * (counts > 0)
            out.index_copy_(0, rows, sub)
        if edits.allow_rows is not None:
            banned = ~edits.allow_masks[:, : out.shape[1]]
            rows = out.index_select(0, edits.allow_rows)
            rows[:, : banned.shape[1]].masked_fill_(banned, -torch.inf)
            rows[:, banned.shape[1]:] = -torch.inf  # columns past the vocabulary (a padded LM head), if any
            out.index_copy_(0, edits.allow_rows, rows)
        return out

    def record(self, tokens: torch.Tensor, edits: LogitEdits | None) -> None:
        """Count the step's kept samples in their slots (on the device, no host sync)."""
        if edits is None or edits.record_rows is None:
            return
        index = (edits.record_slots, tokens.index_select(0, edits.record_rows))
        self.counts.index_put_(index, torch.ones((), dtype=torch.int32, device=self.device), accumulate=True)
