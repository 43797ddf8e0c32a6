"""Counter-based random numbers: one uniform per (seed, output position), no state.

A seeded request must draw the same token at the same output position whatever
happened before: preemption and recompute, another batch, a restart of the
server that re-admits it with its generated tokens. So its randomness is a pure
function of (seed, position) instead of a generator that advances with every
draw (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011,
call this a counter-based generator).

The function is SplitMix64 (Steele, Lea and Flood, "Fast splittable
pseudorandom number generators", OOPSLA 2014, with the 64-bit finalizer
constants of Vigna's public-domain splitmix64 reference), read at a position
instead of advanced::

    key      = seed mod 2**64                     (two's complement bits of an int64 seed)
    state    = mix64(key)                         the stream's starting state
    x(n)     = mix64(state + (n + 1) * GAMMA)     the n-th output, n = 0, 1, ...
    u(n)     = (x(n) >> 11) / 2**53               a float64 in [0, 1), 53 random bits

``mix64`` is a bijection on 64-bit words, so distinct seeds in
[-2**63, 2**63) have distinct starting states (``torch.Generator`` on CPU keeps
only a seed's low 32 bits: seeds -1 and 2**32 - 1 collided), and one stream
never repeats a value within 2**64 positions. Hashing the seed first keeps two
seeds' streams from being shifted copies of each other (raw SplitMix64 seeded
s and s + GAMMA would be).

Parallel sampling (``SamplingParams.n`` / ``best_of``) gives sample i of a
request with seed s its own seed, the (i + 1)-th output of the plain SplitMix64
generator seeded with s (``sample_seed``)::

    seed_i   = int64(mix64((s mod 2**64) + (i + 1) * GAMMA))     i = 0, 1, ...

so sample i draws exactly the tokens of a single request sent with ``seed_i``.

Everything runs on int64 tensors for the whole batch: multiplication wraps
modulo 2**64 as unsigned arithmetic does, and right shifts are made logical
with a mask.
"""

from __future__ import annotations

import secrets

import torch

MIN_SEED = -(2**63)  # the API's seed is a protobuf int64
MAX_SEED = 2**63 - 1

GAMMA = 0x9E3779B97F4A7C15  # odd; 2**64 / golden ratio
_MIX_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_MIX_SHIFTS = (30, 27, 31)
_UNIFORM_BITS = 53  # a float64's mantissa


def random_seed() -> int:
    """A seed for a request that brought none: 64 random bits from ``secrets``, as an int64."""
    return secrets.randbits(64) + MIN_SEED


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` (0, 1, ...) of a request with ``seed`` (see the module's mapping).

    seed: an int64; returns an int64 in [-2**63, 2**63). Pure Python (a handful
    of calls per request).
    """
    assert index >= 0, f"sample index must be >= 0, got {index}"
    x = ((seed % 2**64) + (index + 1) * GAMMA) % 2**64
    first, second, last = _MIX_SHIFTS
    x = ((x ^ (x >> first)) * _MIX_MULTIPLIERS[0]) % 2**64
    x = ((x ^ (x >> second)) * _MIX_MULTIPLIERS[1]) % 2**64
    x ^= x >> last
    return x - 2**64 if x >= 2**63 else x  # the word as a two's complement int64


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer, a bijection on 64-bit words: int64 [n] -> int64 [n]."""
    assert x.dtype == torch.int64, f"mix64 needs int64 words, got {x.dtype}"
    first, second, last = _MIX_SHIFTS
    x = (x ^ _shift_right(x, first)) * _as_int64(_MIX_MULTIPLIERS[0])
    x = (x ^ _shift_right(x, second)) * _as_int64(_MIX_MULTIPLIERS[1])
    return x ^ _shift_right(x, last)


def random_words(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The 64-bit word x(position) of each seed's stream.

    seeds: [n] int64 (any int64: a seed is its own two's complement key);
    positions: [n] int64 >= 0. Returns [n] int64 (the word's bits).
    """
    state = mix64(seeds)
    return mix64(state + (positions + 1) * _as_int64(GAMMA))


def uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """u(position) of each seed's stream: [n] int64, [n] int64 -> [n] float64 in [0, 1)."""
    words = random_words(seeds, positions)
    return _shift_right(words, 64 - _UNIFORM_BITS).to(torch.float64) * 2.0**-_UNIFORM_BITS


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's >> is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _as_int64(word: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return word - (1 << 64) if word >= 1 << 63 else word
