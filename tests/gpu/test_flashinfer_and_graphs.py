"""GPU path: FlashInfer attention against the torch reference, CUDA graphs on against off.

Skipped without CUDA or without flashinfer, so CI on CPU stays green. Each scenario drives the
Engine directly through prefills, a chunked prefill mixed with decodes, and 16 decode steps,
in bf16 on tiny models with head_dim 128 (the shape the Qwen3 benchmarks compile for).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("flashinfer")

from tpserve.config import EngineConfig
from tpserve.forward import SequenceInput
from tpserve.engine.engine import Engine
from tpserve.kvcache.pool import PageAllocator

DECODE_STEPS = 16
# Relative L2 error of bf16 logits between two attention kernels; bf16 rounding alone is ~4e-3.
LOGITS_RTOL = 2e-2
# Two kernels may round differently, so greedy picks may differ where the reference's top two
# logits are closer than this (a near-tie); everywhere else they must agree.
NEAR_TIE = 0.05


@pytest.fixture(scope="module", params=[(4, 2), (8, 2)], ids=["gqa2-cuda-cores", "gqa4-tensor-cores"])
def model_dir(request, tmp_path_factory) -> str:
    from tpserve.tiny import make_tiny_model

    heads, kv_heads = request.param
    out = tmp_path_factory.mktemp(f"tiny-h{heads}-kv{kv_heads}")
    return make_tiny_model(
        str(out), "qwen3", num_layers=2, hidden_size=256, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=128, intermediate_size=512, seed=1,
    )


def make_engine(model_dir: str, backend: str, graph_max_bs: int, page_size: int) -> Engine:
    config = EngineConfig(
        model=model_dir, device="cuda", dtype="bfloat16", attention_backend=backend,
        cuda_graph_max_bs=graph_max_bs, max_total_tokens=16384, page_size=page_size,
    )
    return Engine(config)


def prompts_for(num: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 80, (num,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def run_scenario(
    engine: Engine, prompts: list[list[int]], forced: list[list[int]] | None = None
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens [step][seq] and float logits per step.

    Step 0 prefills every prompt but the last, whose first half is a chunk; step 1 runs its
    second half together with the others' first decode (a mixed step); then decode only.
    With ``forced`` the inputs are those tokens instead of this engine's own (teacher forcing),
    so logits can be compared step by step.
    """
    page_size = engine.page_size
    allocator = PageAllocator(engine.num_pages)
    tables = [allocator.allocate(-(-(len(p) + DECODE_STEPS + 2) // page_size)) for p in prompts]
    last = len(prompts) - 1
    half = max(1, len(prompts[last]) // 2)
    cached = [0] * len(prompts)
    tokens: list[list[int]] = []
    logits_per_step: list[torch.Tensor] = []
    for step in range(DECODE_STEPS + 2):
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
    actual: list[list[int]], expected: list[list[int]], expected_logits: list[torch.Tensor]
) -> None:
    """Every sequence's greedy tokens agree until a near-tie in the reference, if any (after
    that the two runs decode different texts, so the sequence is no longer compared)."""
    diverged: set[int] = set()
    for step, (a_row, e_row) in enumerate(zip(actual, expected)):
        for i, (a, e) in enumerate(zip(a_row, e_row)):
            if i in diverged or a == e:
                continue
            margin = top2_margin(expected_logits[step][i])
            assert margin < NEAR_TIE, f"step {step} seq {i}: token {a} != {e} with a clear margin {margin:.3f}"
            diverged.add(i)
    assert len(diverged) <= len(expected[0]) // 2, f"{len(diverged)} sequences hit near-ties: suspicious"


@pytest.mark.parametrize("page_size", [16, 3])
def test_flashinfer_matches_torch(model_dir, page_size):
    reference = make_engine(model_dir, "torch", 0, page_size)
    vocab = reference.model_config.vocab_size
    prompts = prompts_for(6, vocab, seed=page_size)
    ref_tokens, ref_logits = run_scenario(reference, prompts)
    del reference

    engine = make_engine(model_dir, "flashinfer", 0, page_size)
    assert type(engine.attention).__name__ == "FlashInferAttentionBackend"
    _, forced_logits = run_scenario(engine, prompts, forced=ref_tokens)
    assert_logits_close(forced_logits, ref_logits)
    own_tokens, _ = run_scenario(engine, prompts)
    assert_same_greedy(own_tokens, ref_tokens, ref_logits)


def test_auto_backend_is_flashinfer_on_cuda(model_dir):
    engine = make_engine(model_dir, "auto", 0, 16)
    assert type(engine.attention).__name__ == "FlashInferAttentionBackend"


@pytest.mark.parametrize("batch", [1, 3, 11])
def test_cuda_graphs_match_eager(model_dir, batch):
    eager = make_engine(model_dir, "flashinfer", 0, 16)
    vocab = eager.model_config.vocab_size
    prompts = prompts_for(batch, vocab, seed=100 + batch)
    eager_tokens, eager_logits = run_scenario(eager, prompts)
    del eager

    graphed = make_engine(model_dir, "flashinfer", 16, 16)
    assert graphed.graph_runner is not None and graphed.graph_runner.sizes == [1, 2, 4, 8, 16]
    _, graph_logits = run_scenario(graphed, prompts, forced=eager_tokens)
    assert_logits_close(graph_logits, eager_logits)
    own_tokens, _ = run_scenario(graphed, prompts)
    assert_same_greedy(own_tokens, eager_tokens, eager_logits)


def test_graph_padding_leaves_other_requests_alone(model_dir):
    """A padded replay writes only the scratch page: a second batch's KV stays intact."""
    engine = make_engine(model_dir, "flashinfer", 16, 16)
    before = [k.clone() for k in engine.kv_pool.k]
    allocator = PageAllocator(engine.num_pages)
    page = allocator.allocate(1)
    engine.forward([SequenceInput([5], 0, page)])  # bs 1 graph: no padding
    engine.forward([SequenceInput([6], 1, page), SequenceInput([7], 0, allocator.allocate(1))])
    third = SequenceInput([9], 0, allocator.allocate(1))
    engine.forward([SequenceInput([8], 2, page), third, third])  # bs 3 pads to 4
    torch.cuda.synchronize()
    touched = {0, *range(1, 4)}
    for layer, (old, new) in enumerate(zip(before, engine.kv_pool.k)):
        changed = (old != new).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert set(changed) <= touched, f"layer {layer}: pages {changed} written"
