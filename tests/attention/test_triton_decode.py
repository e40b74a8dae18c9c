"""attention/triton_decode.py: the split-KV decode kernel against float64 attention in Triton's CPU
interpreter, and each of its launches compiled for Hopper (sm_90) on the CPU, so a GPU run starts
from a kernel that compiles. The kernel on a GPU, in the engine and in CUDA graphs:
tests/gpu/test_decode_kernels.py. Skipped where triton is missing (it comes with torch on Linux)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))

# (query heads, kv heads, head_dim, lengths, CHUNK, most splits, prefetch): one token (one split,
# written directly); splits merged by the last program; GQA 1, 4, 5 (not a power of two) and 8;
# lengths on and off page and step edges; more tokens than CHUNK x splits (several steps a split);
# more splits than the merge loads at once (10); the first chunk read before the newest token
# (prefetch), with the newest token inside and outside that chunk; sliding windows (0: none) shorter
# and longer than the sequences, off page and chunk edges, split or not, with and without the prefetch; logit soft-caps
# (the last field, None: none; the scaled scores have a spread of ~1), alone, under a window, over merged splits and
# the prefetched chunk. On the CPU the kernel takes 32 SMs (splits_for).
CASES = [
    (4, 4, 32, [1], 16, 4, 1, 0, None),
    (8, 2, 32, [37, 5], 16, 4, 1, 0, None),
    (8, 1, 32, [100, 16], 16, 8, 0, 0, None),
    (10, 2, 32, [16, 33, 70], 16, 2, 1, 0, None),
    (16, 2, 32, [300], 16, 16, 0, 0, None),
    (8, 2, 128, [129, 64], 64, 32, 0, 0, None),
    (8, 2, 32, [37, 5, 1], 16, 4, 1, 9, None),
    (16, 2, 32, [300, 60], 16, 16, 0, 101, None),
    (8, 1, 32, [100, 16, 33], 16, 8, 1, 33, None),
    (4, 4, 32, [20], 16, 4, 0, 1, None),
    (8, 2, 32, [37, 5, 1], 16, 4, 1, 0, 1.5),
    (10, 2, 32, [16, 33, 70], 16, 2, 0, 20, 0.5),
    (8, 1, 32, [100, 16], 16, 8, 1, 0, 4.0),
]
PAGE = 16
# (query heads, kv heads, lengths, CHUNK, most splits, window, fresh_tokens): the prefetch with a drafted step's rows,
# whose newest `fresh` keys are re-read after the wait: inside one chunk, across a chunk and a split edge, all of a
# short sequence, under a window
FRESH_CASES = [
    (8, 2, [37, 5, 3], 16, 4, 0, 5),
    (8, 1, [100, 33, 18], 16, 8, 0, 5),
    (4, 4, [70, 2], 16, 4, 20, 3),
]


def paged_case(q_heads: int, kv_heads: int, head_dim: int, lengths: list[int], dtype: torch.dtype, seed: int):
    """q, caches, and a dense table wider than needed whose unused columns hold stale page ids."""
    from tpserve.attention.page_table import TableMetadata  # noqa: F401 -- the type the kernel reads

    gen = torch.Generator().manual_seed(seed)
    pool = sum(-(-n // PAGE) for n in lengths) + 8
    q = torch.randn(len(lengths), q_heads, head_dim, generator=gen).to(dtype)
    k_cache, v_cache = (torch.randn(pool, PAGE, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    order = torch.randperm(pool, generator=gen).to(torch.int32)
    table = order[torch.randint(0, pool, (len(lengths), max(-(-n // PAGE) for n in lengths) + 3), generator=gen)]
    used = 0
    for row, n in enumerate(lengths):
        pages = -(-n // PAGE)
        table[row, :pages] = order[used : used + pages]
        used += pages
    return q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32)


def reference(q, k_cache, v_cache, table, lens, scale: float, window: int = 0,
              softcap: float | None = None) -> torch.Tensor:
    """float64 attention; ``softcap``: the scaled scores become softcap * tanh(score / softcap) (Gemma 2's)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    for b, n in enumerate(lens.tolist()):
        pages = table[b, : -(-n // PAGE)].long()
        first = max(n - window, 0) if window else 0
        k, v = (c[pages].flatten(0, 1)[first:n].double().repeat_interleave(group, dim=1) for c in (k_cache, v_cache))
        scores = torch.einsum("hd,thd->ht", q[b].double(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        weights = scores.softmax(dim=-1)
        out[b] = torch.einsum("ht,thd->hd", weights, v)
    return out


def interpreter_check(launches: str) -> None:
    """Run under TRITON_INTERPRET=1: float32 against float64, each case twice (the merge counters
    must be back at zero for the second call), then the bf16 launches the GPU runs, recorded into
    ``launches`` for the Hopper compile."""
    from hopper_compile import record_launches

    from tpserve.attention.page_table import TableMetadata
    from tpserve.attention.triton_decode import TritonDecode

    for i, (q_heads, kv_heads, head_dim, lengths, chunk, splits, prefetch, window, softcap) in enumerate(CASES):
        q, k_cache, v_cache, table, lens = paged_case(q_heads, kv_heads, head_dim, lengths, torch.float32, seed=i)
        scale = head_dim**-0.5
        kernel = TritonDecode(q_heads, kv_heads, scale, torch.device("cpu"), max_batch=len(lengths),
                              chunk=chunk, max_splits=splits, prefetch=prefetch, softcap=softcap)
        expected = reference(q, k_cache, v_cache, table, lens, scale, window, softcap)
        if window and window < max(lengths):
            assert not torch.allclose(expected, reference(q, k_cache, v_cache, table, lens, scale, 0, softcap),
                                      atol=1e-3)
        if softcap is not None:  # the cap changes the answer
            assert not torch.allclose(expected, reference(q, k_cache, v_cache, table, lens, scale, window), atol=1e-3)
        for call in range(2):
            got = TableMetadata(kernel, table, lens).attend(q, k_cache, v_cache, window)
            err = float((got.double() - expected).abs().max())
            assert err < 1e-5, f"case {i} call {call}: max error {err:.2e}"
            assert not kernel.counters.any(), f"case {i}: a merge counter was left non-zero"
    for i, (q_heads, kv_heads, lengths, chunk, splits, window, fresh) in enumerate(FRESH_CASES):
        q, k_cache, v_cache, table, lens = paged_case(q_heads, kv_heads, 32, lengths, torch.float32, seed=50 + i)
        kernel = TritonDecode(q_heads, kv_heads, 32**-0.5, torch.device("cpu"), max_batch=len(lengths), chunk=chunk,
                              max_splits=splits, prefetch=1, fresh_tokens=fresh)
        got = TableMetadata(kernel, table, lens).attend(q, k_cache, v_cache, window)
        err = float((got.double() - reference(q, k_cache, v_cache, table, lens, 32**-0.5, window)).abs().max())
        assert err < 1e-5, f"fresh case {i}: max error {err:.2e}"
    record_launches(launches)
    # 2 and 64 splits (32 "SMs"), the prefetch, a window, Gemma 2's soft-cap (under its window), a drafted step's rows
    for q_heads, kv_heads, lengths, prefetch, window, softcap in (
        (32, 4, [40, 1000], 0, 0, None), (8, 1, [3000], 0, 0, None), (32, 8, [512], 1, 0, None),
        (32, 8, [512], 1, 100, None), (8, 4, [300], 1, 100, 50.0), (32, 8, [512, 513, 514], 1, 0, None),
    ):
        q, k_cache, v_cache, table, lens = paged_case(q_heads, kv_heads, 128, lengths, torch.bfloat16, seed=9)
        kernel = TritonDecode(q_heads, kv_heads, 128**-0.5, torch.device("cpu"), max_batch=len(lengths),
                              prefetch=prefetch, softcap=softcap, fresh_tokens=len(lengths))
        TableMetadata(kernel, table, lens).attend(q, k_cache, v_cache, window)
    print("ok")


def test_kernel_matches_float64_and_compiles_for_hopper(tmp_path):
    launches = str(tmp_path / "launches.jsonl")
    paths = [os.path.join(ROOT, "tests", "kernels"), HERE, os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    script = f"import test_triton_decode; test_triton_decode.interpreter_check({launches!r})"
    run = subprocess.run([sys.executable, "-c", script], env={**env, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
    with open(launches) as f:
        kernels = {line.split('"kernel": ')[1].split('"')[1] for line in f}
    assert kernels == {"_decode_kernel"}
    env.pop("TRITON_INTERPRET", None)
    compiled = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "kernels", "hopper_compile.py"), launches],
                              env=env, capture_output=True, text=True, timeout=600, check=False)
    assert compiled.returncode == 0 and compiled.stdout.strip().endswith("ok"), compiled.stdout + compiled.stderr


def test_unsupported_layouts_are_named():
    from tpserve.attention.triton_decode import unsupported_reason

    assert unsupported_reason(128, 32, 8, fp8_cache=False) is None
    assert "not 96" in unsupported_reason(96, 32, 8, fp8_cache=False)
    assert "do not group" in unsupported_reason(128, 30, 8, fp8_cache=False)
    assert "not FP8" in unsupported_reason(128, 32, 8, fp8_cache=True)


def test_config_from_env_names_bad_settings(monkeypatch):
    """``TPSERVE_TRITON_DECODE`` (experiments): the kernel's settings, commas or spaces between them."""
    from tpserve.attention.triton_decode import CONFIG_ENV, config_from_env

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert config_from_env() == {}
    monkeypatch.setenv(CONFIG_ENV, "chunk=16, max_splits=64 num_warps=2")
    assert config_from_env() == {"chunk": 16, "max_splits": 64, "num_warps": 2}
    assert config_from_env("merge_unroll=8 prefetch=0") == {"merge_unroll": 8, "prefetch": 0}
    for bad in ("chunks=16", "chunk=0", "chunk=x", "chunk", "early_launch=0", "prefetch=2"):
        with pytest.raises(ValueError, match=CONFIG_ENV):
            config_from_env(bad)


def test_wide_groups_split_sequences_less():
    """A KV head serving 8+ query heads (Qwen3's MoE models) splits a sequence over at most 16 programs, the
    dense models' 4 over 32 (whole-step measurements in the constants' comment); an explicit setting wins."""
    from tpserve.attention.triton_decode import MAX_SPLITS, WIDE_GROUP_MAX_SPLITS, TritonDecode

    cpu = torch.device("cpu")
    assert TritonDecode(32, 4, 0.1, cpu, max_batch=1).max_splits == WIDE_GROUP_MAX_SPLITS == 16
    assert TritonDecode(64, 4, 0.1, cpu, max_batch=1).max_splits == 16
    assert TritonDecode(32, 8, 0.1, cpu, max_batch=1).max_splits == MAX_SPLITS == 32
    assert TritonDecode(32, 4, 0.1, cpu, max_batch=1, max_splits=64).max_splits == 64
