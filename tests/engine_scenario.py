"""Driving an Engine through a fixed scenario (prefills, a chunked prefill mixed with decodes,
decode steps) and comparing two runs' logits and greedy tokens; shared by the GPU tests and the
CPU tests of the comparisons themselves."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tpserve.engine.batch import one_token_rows
from tpserve.engine.engine import Engine
from tpserve.forward import SequenceInput
from tpserve.kvcache.pool import PageAllocator

DECODE_STEPS = 16
# Relative L2 error of bf16 logits between two attention kernels; bf16 rounding alone is ~4e-3.
LOGITS_RTOL = 2e-2
# Two kernels may round differently, so greedy picks may differ where the reference's top two
# logits are closer than this (a near-tie); everywhere else they must agree.
NEAR_TIE = 0.05


def prompts_for(num: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 80, (num,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def run_scenario(
    engine: Engine, prompts: list[list[int]], forced: list[list[int]] | None = None, decode_steps: int = DECODE_STEPS
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens [step][seq] and float logits per step.

    Step 0 prefills every prompt but the last, whose first half is a chunk; step 1 runs its
    second half together with the others' first decode (a mixed step); then decode only.
    With ``forced`` the inputs are those tokens instead of this engine's own (teacher forcing),
    so logits can be compared step by step.
    """
    page_size = engine.page_size
    allocator = PageAllocator(engine.num_pages)
    tables = [allocator.allocate(-(-(len(p) + decode_steps + 2) // page_size)) for p in prompts]
    last = len(prompts) - 1
    half = max(1, len(prompts[last]) // 2)
    cached = [0] * len(prompts)
    tokens: list[list[int]] = []
    logits_per_step: list[torch.Tensor] = []
    for step in range(decode_steps + 2):
        seqs, rows = [], []
        for i, prompt in enumerate(prompts):
            if step == 0:
                new = prompt[:half] if i == last else prompt
            elif step == 1 and i == last:
                new = prompt[half:] if half < len(prompt) else None
            else:
                new = [(forced or tokens)[step - 1][i]]
            if new is None:  # the chunk was the whole prompt: nothing to run this step
                continue
            seqs.append(SequenceInput(list(new), cached[i], tables[i]))
            rows.append(i)
            cached[i] += len(new)
        step_tokens = list(tokens[-1]) if tokens else [0] * len(prompts)
        vocab = engine.model_config.vocab_size
        step_logits = torch.full((len(prompts), vocab), float("nan"), device=engine.device)
        if not seqs:  # a one-sequence batch whose chunk was its whole prompt
            tokens.append(step_tokens)
            logits_per_step.append(step_logits)
            continue
        logits = engine.forward(seqs).float().clone()
        picked = logits.argmax(dim=-1).tolist()
        for row, i in enumerate(rows):
            # The last prompt's first chunk yields no token; keep its row out of the results.
            if not (step == 0 and i == last and half < len(prompts[last])):
                step_tokens[i] = picked[row]
                step_logits[i] = logits[row]
        tokens.append(step_tokens)
        logits_per_step.append(step_logits)
    return tokens, logits_per_step


def teacher_forced_errors(
    make_engine: Callable[[str, str], Engine], engine_dir: str, reference_dir: str
) -> tuple[list[float], tuple[list[list[int]], list[list[int]], list[torch.Tensor]]]:
    """The relative logits error of each step: ``make_engine(engine_dir, "flashinfer")`` teacher-forced on the tokens of
    ``make_engine(reference_dir, "torch")``; with (its own greedy tokens, the reference's tokens and logits) for
    ``assert_same_greedy``. Each engine is dropped before the next is built (two may not fit beside a graph pool)."""
    reference = make_engine(reference_dir, "torch")
    prompts = prompts_for(6, reference.model_config.vocab_size, seed=7)
    ref_tokens, ref_logits = run_scenario(reference, prompts)
    del reference
    engine = make_engine(engine_dir, "flashinfer")
    assert engine.graph_runner is not None
    _, forced_logits = run_scenario(engine, prompts, forced=ref_tokens)
    steps = []
    for actual, expected in zip(forced_logits, ref_logits):
        valid = ~torch.isnan(expected[:, 0])
        assert torch.equal(valid, ~torch.isnan(actual[:, 0])) and torch.isfinite(actual[valid]).all()
        steps.append(float((actual[valid] - expected[valid]).norm() / expected[valid].norm()))
    own_tokens, _ = run_scenario(engine, prompts)
    return steps, (own_tokens, ref_tokens, ref_logits)


def assert_logits_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for step, (a, e) in enumerate(zip(actual, expected)):
        valid = ~torch.isnan(e[:, 0])
        assert torch.equal(valid, ~torch.isnan(a[:, 0])), f"step {step}: different rows ran"
        if not valid.any():
            continue
        a, e = a[valid], e[valid]
        assert torch.isfinite(a).all(), f"step {step}: non-finite logits"
        err = (a - e).norm() / e.norm()
        assert err < LOGITS_RTOL, f"step {step}: relative logits error {err:.2e}"


def top2_margin(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_same_greedy(
    actual: list[list[int]], expected: list[list[int]], expected_logits: list[torch.Tensor], near_tie: float = NEAR_TIE,
    ties_expected: bool = False,
) -> None:
    """Every sequence's greedy tokens agree until a near-tie (top two within ``near_tie``) in the reference, if any
    (after that the two runs decode different texts, so the sequence is no longer compared). More than half the
    sequences parting at near-ties is suspicious, unless ``ties_expected`` (a model whose margins are mostly within
    the dtype's rounding; its caller holds the logits to a reference)."""
    diverged: set[int] = set()
    for step, (a_row, e_row) in enumerate(zip(actual, expected)):
        for i, (a, e) in enumerate(zip(a_row, e_row)):
            if i in diverged or a == e:
                continue
            margin = top2_margin(expected_logits[step][i])
            assert margin < near_tie, f"step {step} seq {i}: token {a} != {e} with a clear margin {margin:.3f}"
            diverged.add(i)
    suspicious = not ties_expected and len(diverged) > len(expected[0]) // 2
    assert not suspicious, f"{len(diverged)} sequences hit near-ties: suspicious"


# Mixture-of-experts models in bf16: a router near a tie between its k-th and (k+1)-th expert picks
# either, depending on rounding, and the other expert moves that token (and, through attention, the
# tokens after it) far more than rounding does. On the tiny Qwen3-MoE model of the GPU tests
# (16 experts, top 4) 4% of the router's decisions have those two probabilities within 1%. So two
# correct bf16 runs agree on most rows, not all: the median row within ROUTED_MEDIAN_RTOL and at
# most ROUTED_OUTLIERS of the rows past LOGITS_RTOL. A wrong expert path moves nearly every row.
ROUTED_MEDIAN_RTOL = 1e-2
ROUTED_OUTLIERS = 0.1


def row_errors(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> torch.Tensor:
    """Relative L2 error of every row that ran, over all steps."""
    errors = []
    for step, (a, e) in enumerate(zip(actual, expected)):
        valid = ~torch.isnan(e[:, 0])
        assert torch.equal(valid, ~torch.isnan(a[:, 0])), f"step {step}: different rows ran"
        a, e = a[valid], e[valid]
        assert torch.isfinite(a).all(), f"step {step}: non-finite logits"
        errors.append((a - e).norm(dim=-1) / e.norm(dim=-1))
    return torch.cat(errors)


def assert_routed_logits_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    errors = row_errors(actual, expected)
    median, outliers = float(errors.median()), float((errors > LOGITS_RTOL).float().mean())
    summary = f"median row error {median:.2e}, {outliers:.0%} of {errors.numel()} rows past {LOGITS_RTOL}"
    assert median < ROUTED_MEDIAN_RTOL and outliers <= ROUTED_OUTLIERS, summary


def assert_prefill_never_waits(engine: Engine, tokens: int) -> None:
    """One prompt of ``tokens`` tokens prefilled twice; the second forward must enqueue without a host sync (one a
    layer drains the GPU between the layers' launches: session 30 found one in every MoE layer). torch's sync
    debug mode raises on any. The first run may compile and plan with syncs of its own."""
    vocab = engine.model_config.vocab_size
    pages = list(range(1, -(-tokens // engine.page_size) + 1))
    seq = SequenceInput([(7 * i) % vocab for i in range(tokens)], 0, pages)
    engine.forward([seq])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.forward([seq])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()



def drafted_step_logits(engine: Engine, drafts: list[int], seed: int = 3) -> tuple[torch.Tensor, ...]:
    """A drafted step (speculative decoding's verify: each sequence's last token, then ``drafts[i]`` drafts, every
    position's logits wanted) after prefilled prompts: its logits [B + drafts, vocab] as the engine runs it (with
    CUDA graphs: a decode graph, a row a token), as one-token rows (``one_token_rows``), and eagerly, a chunk a
    sequence."""
    vocab, page_size = engine.model_config.vocab_size, engine.page_size
    prompts = prompts_for(len(drafts), vocab, seed)
    gen = torch.Generator().manual_seed(seed)
    allocator = PageAllocator(engine.num_pages)
    tables = [allocator.allocate(-(-(len(p) + n + 1) // page_size)) for p, n in zip(prompts, drafts)]
    engine.forward([SequenceInput(p, 0, t) for p, t in zip(prompts, tables)])
    seqs = [SequenceInput(torch.randint(0, vocab, (n + 1,), generator=gen).tolist(), len(p), t, extra_logits=n)
            for p, t, n in zip(prompts, tables, drafts)]
    as_run = engine.forward(seqs).float().clone()
    rows = one_token_rows(seqs, max(drafts) + 1)
    as_rows = engine.forward(rows.seqs).float()[torch.from_numpy(rows.order).to(engine.device)].clone()
    runner, engine.graph_runner = engine.graph_runner, None
    try:
        chunked = engine.forward(seqs).float().clone()
    finally:
        engine.graph_runner = runner
    return as_run, as_rows, chunked
