"""Sampler: greedy, distributions under temperature/top-k/top-p/min-p, and the counter-based RNG."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tpserve.engine.sampler import Sampler, SamplingBatch, random_bits, uniform_noise
from tpserve.sampling_params import SamplingParams as SP

# The distribution tests draw N samples from one row of logits, one request (seed) per sample.
N = 20_000
# Eight distinct probabilities, placed at shuffled vocab positions, chosen so no top-p or min-p
# cut used below lies near a boundary.
PROBS = torch.tensor([0.04, 0.25, 0.01, 0.35, 0.10, 0.02, 0.15, 0.08], dtype=torch.float64)
LOGITS = PROBS.log().float()


def sample(
    logits: torch.Tensor, params: list[SP], seeds: list[int], steps: list[int] | None = None
) -> torch.Tensor:
    steps = [0] * len(params) if steps is None else steps
    batch = SamplingBatch.build(params, seeds, steps, logits.shape[-1], "cpu")
    return Sampler()(logits, batch)


def sample_row(logits: torch.Tensor, params: SP, n: int = N, seed0: int = 0) -> torch.Tensor:
    """n samples of one row of logits, each from its own seed."""
    return sample(logits.expand(n, -1).contiguous(), [params] * n, list(range(seed0, seed0 + n)))


def expected_probs(logits: torch.Tensor, p: SP) -> torch.Tensor:
    """Reference filter chain in float64: temperature -> top-k -> top-p -> min-p."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    kept = order[: p.top_k] if p.top_k > 0 else order
    total = sum(probs[i].item() for i in kept)
    mass, prefix = 0.0, []
    for i in kept:
        prefix.append(i)
        mass += probs[i].item() / total
        if mass >= p.top_p:
            break
    top = probs[order[0]].item()
    final = [i for i in prefix if probs[i].item() >= p.min_p * top]
    out = torch.zeros_like(probs)
    out[final] = probs[final] / probs[final].sum()
    return out


def chi2_stat(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs * tokens.numel()
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled tokens with probability 0: {counts.tolist()}"
    return (((counts - expected) ** 2)[support] / expected[support]).sum().item()


def chi2_critical(df: int, z: float = 3.72) -> float:
    """Upper 1e-4 quantile of chi-square(df), Wilson-Hilferty approximation."""
    if df == 0:
        return 0.0
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def assert_distribution(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    stat = chi2_stat(tokens, probs)
    df = int((probs > 0).sum()) - 1
    counts = torch.bincount(tokens).tolist()
    assert stat <= chi2_critical(df), f"chi2 {stat:.1f} with {df} dof; counts {counts}"


# --- the counter-based RNG -------------------------------------------------------------------

M32 = 0xFFFF_FFFF


def ref_mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & M32
    x ^= x >> 15
    x = (x * 0x735A2D97) & M32
    return x ^ (x >> 15)


def ref_bits(seed: int, step: int, v: int) -> int:
    key = 0x9E3779B9
    for word in (seed, seed >> 32, step, step >> 32):
        key = ref_mix32(key ^ (word & M32))
    return ref_mix32(key ^ ref_mix32(v ^ 0x85EBCA6B))


def test_hash_is_bit_identical_to_pure_python_reference():
    seeds = [0, 1, 2, 12345, 2**32 - 1, 2**32, 2**62 + 7, 2**63 - 1, -1, -(2**63)]
    steps = [0, 1, 7, 2**31, 2**40 + 3, 0, 5, 2**63 - 1, 3, 9]
    vocab = 300
    got = random_bits(torch.tensor(seeds), torch.tensor(steps), vocab)
    want = torch.tensor([[ref_bits(s, t, v) for v in range(vocab)] for s, t in zip(seeds, steps)])
    assert torch.equal(got, want)

    u = uniform_noise(torch.tensor(seeds), torch.tensor(steps), vocab)
    want_u = [[((b >> 9) + 0.5) / 2**23 for b in row] for row in want.tolist()]
    want_u = torch.tensor(want_u, dtype=torch.float32)
    assert u.dtype == torch.float32 and torch.equal(u, want_u)
    assert 0.0 < u.min().item() and u.max().item() < 1.0


def test_hash_bits_look_independent():
    seeds = torch.arange(128)
    bits = random_bits(seeds, torch.zeros_like(seeds), 2048)
    # Every bit is set half the time (sd 0.002 over the first 65k draws).
    ones = ((bits[:32, :, None] >> torch.arange(32)) & 1).double().mean(dim=(0, 1))
    assert (ones - 0.5).abs().max() < 0.01, ones
    u = (bits >> 9).double() / 2**23
    assert abs(u.mean().item() - 0.5) < 0.003 and abs(u.var().item() - 1 / 12) < 0.002

    def corr(a: torch.Tensor, b: torch.Tensor) -> float:
        return torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()

    steps_u = (random_bits(seeds, torch.ones_like(seeds), 2048) >> 9).double()
    assert abs(corr(u[:-1], u[1:])) < 0.01  # neighbouring seeds
    assert abs(corr(u[:, :-1], u[:, 1:])) < 0.01  # neighbouring vocab entries
    assert abs(corr(u, steps_u)) < 0.01  # neighbouring steps


def test_sampler_leaves_global_rng_alone():
    logits = torch.randn(4, 50)
    state = torch.get_rng_state()
    sample(logits, [SP(temperature=1.0, top_p=0.9)] * 4, [1, 2, 3, 4])
    assert torch.equal(torch.get_rng_state(), state)


# --- greedy -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax_with_ties(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (64, 40), generator=gen).to(dtype)  # many ties
    tokens = sample(logits, [SP(temperature=0.0)] * 64, list(range(64)))
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, torch.argmax(logits, dim=-1))
    lowest_max = [row.index(max(row)) for row in logits.float().tolist()]
    assert tokens.tolist() == lowest_max


def test_greedy_rows_in_a_sampled_batch():
    logits = torch.randint(0, 3, (40, 30), generator=torch.Generator().manual_seed(1)).float()
    sampled = SP(temperature=2.0, top_k=10, top_p=0.7, min_p=0.1)
    params = [SP(temperature=0.0) if i % 3 == 0 else sampled for i in range(40)]
    tokens = sample(logits, params, list(range(40)))
    greedy = torch.arange(40) % 3 == 0
    assert torch.equal(tokens[greedy], logits.argmax(dim=-1)[greedy])


@pytest.mark.parametrize("temperature", [1e-4, 1e-6, 1e-50, 5e-324])
def test_tiny_temperature_is_greedy(temperature):
    """Even where logits / t overflows to inf (1e-50), never a sample at random."""
    logits = torch.randn(32, 500, generator=torch.Generator().manual_seed(2))
    tokens = sample(logits, [SP(temperature=temperature)] * 32, list(range(32)))
    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0])
def test_temperature_must_be_finite_and_not_negative(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SP(temperature=temperature)


# --- reproducibility --------------------------------------------------------------------------

VOCAB = 1000


def random_params(rng: random.Random) -> SP:
    return SP(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.5]),
        top_k=rng.choice([-1, 0, 1, 5, 50, 2000]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.05]),
    )


def test_same_seed_and_step_same_token_whatever_the_batch():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(3)
    # Flat-ish logits so that most rows have many plausible tokens.
    requests = [
        (torch.randn(VOCAB, generator=gen) * 0.5, random_params(rng), rng.randrange(2**63), step)
        for step in range(60)
    ]

    def run(members: list[int]) -> dict[int, int]:
        logits = torch.stack([requests[i][0] for i in members])
        _, params, seeds, steps = zip(*(requests[i] for i in members))
        tokens = sample(logits, list(params), list(seeds), list(steps))
        return dict(zip(members, tokens.tolist()))

    alone = {i: run([i])[i] for i in range(len(requests))}
    for size in (2, 7, 33, 60):
        for _ in range(3):
            members = rng.sample(range(len(requests)), size)
            assert run(members) == {i: alone[i] for i in members}
    assert len(set(alone.values())) > 20, "the requests should not all pick the same token"


def test_duplicate_requests_in_one_batch_agree():
    logits = torch.zeros(10, VOCAB)
    tokens = sample(logits, [SP(temperature=1.0, top_p=0.95)] * 10, [7] * 10, [3] * 10)
    assert len(set(tokens.tolist())) == 1


def test_different_seeds_and_steps_give_different_tokens():
    n = 500
    logits = torch.zeros(n, VOCAB)  # uniform: 500 draws hit ~393 distinct tokens
    by_seed = sample(logits, [SP()] * n, list(range(n)))
    by_step = sample(logits, [SP()] * n, [42] * n, list(range(n)))
    assert len(set(by_seed.tolist())) > 350
    assert len(set(by_step.tolist())) > 350
    assert (by_seed != by_step).float().mean() > 0.9


# --- distributions ----------------------------------------------------------------------------


def test_distribution_matches_softmax():
    assert_distribution(sample_row(LOGITS, SP()), PROBS)


def test_distribution_over_steps_of_one_request_matches_softmax():
    tokens = sample(LOGITS.expand(N, -1).contiguous(), [SP()] * N, [1234] * N, list(range(N)))
    assert_distribution(tokens, PROBS)


def test_uniform_over_a_larger_vocab():
    tokens = sample_row(torch.zeros(64), SP(), n=N)
    assert_distribution(tokens, torch.full((64,), 1 / 64, dtype=torch.float64))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature(temperature):
    tokens = sample_row(LOGITS, SP(temperature=temperature))
    assert_distribution(tokens, torch.softmax(LOGITS.double() / temperature, dim=-1))
    # The test has the power to tell: the untempered distribution is rejected.
    assert chi2_stat(tokens, PROBS) > 10 * chi2_critical(7)


@pytest.mark.parametrize("top_k", [1, 3, 7])
def test_top_k(top_k):
    params = SP(temperature=0.9, top_k=top_k)
    tokens = sample_row(LOGITS, params)
    top = set(LOGITS.topk(top_k).indices.tolist())
    assert set(tokens.tolist()) <= top
    assert_distribution(tokens, expected_probs(LOGITS, params))


@pytest.mark.parametrize("disabled", [-1, 0, 8, 100])
def test_top_k_disabled_changes_nothing(disabled):
    tokens = sample_row(LOGITS, SP(top_k=disabled), n=2000)
    assert torch.equal(tokens, sample_row(LOGITS, SP(), n=2000))


@pytest.mark.parametrize(
    "params, kept",
    [
        (SP(top_p=0.7), 3),  # 0.35, 0.6, 0.75 >= 0.7
        (SP(top_p=0.9), 5),  # ..., 0.85, 0.93
        (SP(top_p=0.3), 1),  # the top token alone already reaches it
        (SP(top_p=0.01), 1),
        (SP(top_p=1e-50), 1),  # 0 in float32: the top token still stays (was an index of -1)
        # top-p after top-k, on the renormalised top 3: 0.467, 0.8 >= 0.78 keeps 2
        # (3 if it were not renormalised).
        (SP(top_k=3, top_p=0.78), 2),
    ],
)
def test_top_p(params, kept):
    probs = expected_probs(LOGITS, params)
    assert int((probs > 0).sum()) == kept
    tokens = sample_row(LOGITS, params)
    assert set(tokens.tolist()) == set(PROBS.argsort(descending=True)[:kept].tolist())
    assert_distribution(tokens, probs)


@pytest.mark.parametrize(
    "params, kept",
    [
        (SP(min_p=0.3), 3),  # p >= 0.105
        (SP(min_p=0.5), 2),  # p >= 0.175
        (SP(min_p=1.0), 1),
        (SP(temperature=2.0, min_p=0.3), 6),  # flatter: the cut moves
    ],
)
def test_min_p(params, kept):
    probs = expected_probs(LOGITS, params)
    assert int((probs > 0).sum()) == kept
    tokens = sample_row(LOGITS, params)
    assert_distribution(tokens, probs)


MIXED = [
    SP(temperature=0.0),
    SP(temperature=0.6),
    SP(temperature=1.3, top_k=4),
    SP(temperature=1.0, top_p=0.8),  # top-p without top-k: needs the full sort
    SP(temperature=1.0, min_p=0.2),
    SP(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1),
    SP(temperature=1.7, top_k=6, min_p=0.15),
]


def test_mixed_batch_with_all_features():
    gen = torch.Generator().manual_seed(4)
    row_logits = [torch.randn(8, generator=gen) * 1.5 for _ in MIXED]
    per_config = 4000
    configs = [i % len(MIXED) for i in range(per_config * len(MIXED))]
    logits = torch.stack([row_logits[c] for c in configs])
    seeds = list(range(len(configs)))
    tokens = sample(logits, [MIXED[c] for c in configs], seeds)

    config_of = torch.tensor(configs)
    for c, params in enumerate(MIXED):
        mine = tokens[config_of == c]
        if params.greedy:
            assert (mine == row_logits[c].argmax()).all()
        else:
            assert_distribution(mine, expected_probs(row_logits[c], params))
        # Each row is what a batch of its own config alone gives (another sort subset and width).
        my_seeds = [s for s, k in zip(seeds, configs) if k == c]
        alone = sample(logits[config_of == c], [params] * per_config, my_seeds)
        assert torch.equal(mine, alone)


def test_minus_inf_logits_are_never_sampled():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(5))
    logits[:, ::3] = float("-inf")
    allowed = torch.isfinite(logits[0])
    # 1e300 is infinite in float32: -inf / inf would be NaN, and NaN wins the race
    for params in (SP(), SP(temperature=3, top_k=90), SP(top_p=0.999), SP(min_p=0.01), SP(temperature=0),
                   SP(temperature=1e300), SP(temperature=1e300, top_p=0.5)):
        tokens = sample_row(logits[0], params, n=1000)
        assert allowed[tokens].all(), params


def test_top_k_keeps_ties_with_the_kth_token():
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0, 0.0])
    tokens = sample_row(logits, SP(top_k=2), n=5000)
    assert set(tokens.tolist()) == {0, 1, 2}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits(dtype):
    params = [MIXED[i % len(MIXED)] for i in range(1000)]
    logits = torch.randn(1000, 300, generator=torch.Generator().manual_seed(6)).to(dtype)
    tokens = sample(logits, params, list(range(1000)))
    assert torch.equal(tokens, sample(logits.float(), params, list(range(1000))))
    low = LOGITS.to(dtype)
    assert_distribution(sample_row(low, SP()), torch.softmax(low.double(), dim=-1))


# --- building the batch -----------------------------------------------------------------------


def test_build():
    params = [
        SP(temperature=0.0, top_k=5, top_p=0.5),
        SP(top_k=-1),
        SP(top_k=0, min_p=0.1),
        SP(top_k=500),
        SP(top_k=7),
    ]
    batch = SamplingBatch.build(params, [1, 2, 3, 4, 5], [0, 0, 9, 1, 2], 100, "cpu")
    assert batch.top_ks.tolist() == [5, 100, 100, 100, 7]
    assert batch.temperatures.dtype == batch.top_ps.dtype == batch.min_ps.dtype == torch.float32
    assert batch.seeds.tolist() == [1, 2, 3, 4, 5] and batch.steps.tolist() == [0, 0, 9, 1, 2]
    assert not batch.all_greedy and batch.any_greedy
    # The greedy row's top-p does not count; only row 4 sorts, and only its top 7.
    assert batch.needs_top_k and not batch.needs_top_p and batch.needs_min_p
    assert batch.sort_rows.tolist() == [4] and batch.sort_width == 7

    plain = SamplingBatch.build([SP(), SP(temperature=0.0)], [1, 2], [0, 0], 100, "cpu")
    assert not (plain.needs_top_k or plain.needs_top_p or plain.needs_min_p)
    assert SamplingBatch.build([SP(temperature=0.0)] * 2, [1, 2], [0, 0], 100, "cpu").all_greedy
    with pytest.raises(ValueError, match="2 seeds"):
        SamplingBatch.build([SP()], [1, 2], [0], 100, "cpu")


def test_greedy_step_uploads_no_parameters():
    """An all-greedy batch's argmax reads none of the parameter tensors, so none is uploaded (each copy
    is an operation between two decode steps' CUDA graphs); a sampled batch uploads them on first use."""
    logits = torch.randn(2, 50)
    greedy = SamplingBatch.build([SP(temperature=0.0)] * 2, [1, 2], [0, 0], 50, "cpu")
    assert torch.equal(Sampler()(logits, greedy), logits.argmax(-1))
    assert not {"_floats", "_ints", "sort_rows"} & set(vars(greedy))
    sampled = SamplingBatch.build([SP(temperature=0.7)] * 2, [1, 2], [0, 0], 50, "cpu")
    Sampler()(logits, sampled)
    assert {"_floats", "_ints"} <= set(vars(sampled))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7])
def test_build_rows_start_16_byte_aligned(rows):
    """The sampler's kernels get these tensors: each must start aligned whatever the batch size
    (Triton compiles a variant per pointer alignment)."""
    batch = SamplingBatch.build([SP(temperature=0.5, top_k=3)] * rows, list(range(rows)), [0] * rows, 100, "cpu")
    for tensor in (batch.temperatures, batch.top_ks, batch.top_ps, batch.min_ps, batch.seeds, batch.steps):
        assert tensor.data_ptr() % 16 == 0 and tensor.shape == (rows,)
    assert batch.seeds.tolist() == list(range(rows))


def test_cpu_scratch_does_not_keep_a_burst_peak():
    """A 150-row step at a 150k vocabulary must not leave ~550 MB of scratch behind."""
    sampler = Sampler()
    logits = torch.randn(150, 151_936)
    sample_batch = SamplingBatch.build([SP(temperature=0.8)] * 150, list(range(150)), [0] * 150, 151_936, "cpu")
    sampler(logits, sample_batch)
    assert sampler._ws.retained_bytes <= 4 * sampler._ws.max_retained_bytes
    small = SamplingBatch.build([SP(temperature=0.8)] * 2, [0, 1], [0, 0], 1000, "cpu")
    first = sampler(torch.randn(2, 1000), small)
    assert sampler._ws.retained_bytes > 0  # small steps still reuse their buffers
    assert first.shape == (2,)
