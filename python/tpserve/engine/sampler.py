"""Batched next-token sampling that every tensor-parallel rank computes identically.

Each row of a step has its own temperature, top-k, top-p, min-p and seed. The per-step path is
vectorised torch (no Python loop over requests or tokens), so it is the same code on CPU and GPU.

Randomness is counter-based, not drawn from a generator: the noise for request ``i`` at output
step ``s`` and vocab index ``v`` is a pure function of ``(seed_i, s, v)`` (see
``random_bits``). So ranks holding identical logits pick identical tokens without talking, and a
seeded request samples the same tokens whatever else shares its batch.

Order of operations for a sampled row (greedy rows, temperature 0, are a plain argmax):

1. temperature: ``w = exp((logits - max) / t)``, unnormalised probabilities whose top is exactly 1;
2. top-k: keep the k largest;
3. top-p: keep the smallest prefix (largest first) whose mass, renormalised over what top-k
   kept, reaches ``top_p``; the top token is always kept;
4. min-p: drop tokens with ``p < min_p * p_max``;
5. race: ``token = argmax(w / E)`` with ``E ~ Exp(1)`` per token. This draws from ``w``
   renormalised over the kept tokens (the Gumbel-max trick in exponential form), so no step ever
   needs to renormalise explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tpserve.sampling_params import SamplingParams

_MASK32 = 0xFFFF_FFFF
# Multipliers of the splitmix32 output function (hash-prospector). Both are below 2**31, so a
# uint32 held in an int64 times either stays below 2**63: no signed overflow on any device.
_MUL1 = 0x21F0_AAAD
_MUL2 = 0x735A_2D97
# Distinct starting values keep the row keys and the column keys apart.
_ROW_DOMAIN = 0x9E37_79B9
_COL_DOMAIN = 0x85EB_CA6B
_UNIFORM_BITS = 23  # k + 0.5 is exact in float32 for k < 2**23, so u never rounds to 0 or 1


def _mix32_(x: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """In place: the splitmix32 output function on uint32 values held in an int64 tensor.

    Every intermediate stays non-negative and below 2**63, so ``>>`` is a logical shift and the
    result is bit-identical to uint32 arithmetic on every device.
    """
    tmp = torch.empty_like(x) if scratch is None else scratch
    for mul, shift in ((_MUL1, 16), (_MUL2, 15)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        x.bitwise_xor_(tmp).mul_(mul).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(x, 15, out=tmp)
    return x.bitwise_xor_(tmp)


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[B] uint32 key per (seed, step): the four 32-bit words absorbed one mix at a time."""
    key = torch.full_like(seeds, _ROW_DOMAIN)
    for word in (seeds, seeds >> 32, steps, steps >> 32):
        key = _mix32_(key ^ (word & _MASK32))
    return key


def _col_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[V] uint32 key per vocab index."""
    return _mix32_(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ _COL_DOMAIN)


def random_bits(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] int64 of uniform uint32 values: ``mix32(row_key(seed, step) ^ col_key(v))``."""
    bits = _row_keys(seeds, steps)[:, None] ^ _col_keys(vocab_size, seeds.device)[None, :]
    return _mix32_(bits)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 uniforms in the open interval (0, 1): ``((bits >> 9) + 0.5) / 2**23``."""
    bits = random_bits(seeds, steps, vocab_size)
    u = bits.bitwise_right_shift_(32 - _UNIFORM_BITS).to(torch.float32)
    return u.add_(0.5).mul_(2.0**-_UNIFORM_BITS)


