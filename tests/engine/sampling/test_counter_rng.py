"""The counter-based random numbers: SplitMix64 read at (seed, position)."""

from __future__ import annotations

import itertools

import torch

from nanoserve.engine.sampling.counter_rng import GAMMA, MAX_SEED, MIN_SEED, mix64, random_seed, random_words, uniforms

# Seeds that torch's CPU generator (mt19937, seeded from the low 32 bits) folded together,
# and other extremes of the protobuf int64 range.
EXTREME_SEEDS = [
    0,
    1,
    -1,
    2,
    2**31 - 1,
    2**31,
    -(2**31),
    2**32 - 1,
    2**32,
    2**32 + 1,
    -(2**32),
    2**53,
    2**62,
    MAX_SEED,
    MIN_SEED,
    MIN_SEED + 1,
    GAMMA - 2**64,  # the splitmix64 increment: raw splitmix64 seeded with it is seed 0 shifted by one
]


def _signed(word: int) -> int:
    """The int64 with the bits of ``word mod 2**64``."""
    word %= 2**64
    return word - 2**64 if word >= 2**63 else word


def _unsigned(words: torch.Tensor) -> list[int]:
    return [w % 2**64 for w in words.tolist()]


def test_mix64_reproduces_the_splitmix64_reference_outputs() -> None:
    # splitmix64 started at state 1234567: its published first five outputs.
    states = torch.tensor([_signed(1234567 + (n + 1) * GAMMA) for n in range(5)])
    words = mix64(states)
    assert _unsigned(words) == [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
        4593380528125082431,
        16408922859458223821,
    ]


def test_extreme_seeds_give_pairwise_different_draws() -> None:
    # Issue 9: seeds 2**63 - 1, -1 and 2**32 - 1 drew the same numbers, as did -2**63 and 0.
    num_positions = 16
    seeds = torch.tensor(EXTREME_SEEDS).repeat_interleave(num_positions)
    positions = torch.arange(num_positions).repeat(len(EXTREME_SEEDS))
    words = _unsigned(random_words(seeds, positions))
    draws = uniforms(seeds, positions).view(len(EXTREME_SEEDS), num_positions).tolist()
    assert len(set(words)) == len(words)  # no raw word repeats, within a stream or across streams
    for a, b in itertools.combinations(range(len(EXTREME_SEEDS)), 2):
        assert not set(draws[a]) & set(draws[b]), (EXTREME_SEEDS[a], EXTREME_SEEDS[b])


def test_distinct_seeds_have_distinct_starting_states() -> None:
    # mix64 is a bijection: checked here on every seed that differs from 0 in one bit, and their negations.
    seeds = [0] + [1 << bit for bit in range(63)] + [-(1 << bit) for bit in range(64)]
    states = _unsigned(mix64(torch.tensor(seeds)))
    assert len(set(states)) == len(seeds)


def test_draw_is_a_function_of_seed_and_position_only() -> None:
    seeds = torch.tensor([5, -7, MAX_SEED, 5])
    positions = torch.tensor([0, 3, 1000, 0])
    together = uniforms(seeds, positions).tolist()
    alone = [uniforms(seeds[i : i + 1], positions[i : i + 1]).item() for i in range(4)]
    assert together == alone
    assert together[0] == together[3]


def test_uniforms_are_in_the_unit_interval_and_evenly_spread() -> None:
    # 20 bins, 19 degrees of freedom: P(chi2 > 43.82) = 0.001; deterministic for these seeds.
    seeds = torch.arange(-1000, 1000).repeat_interleave(10)
    positions = torch.arange(10).repeat(2000)
    u = uniforms(seeds, positions)
    assert u.dtype == torch.float64
    assert bool(((u >= 0.0) & (u < 1.0)).all())
    counts = torch.bincount((u * 20).long(), minlength=20).tolist()
    expected = len(u) / 20
    chi2 = sum((c - expected) ** 2 / expected for c in counts)
    assert chi2 < 43.82, chi2


def test_random_seed_is_an_int64_and_fresh_each_time() -> None:
    seeds = [random_seed() for _ in range(100)]
    assert all(isinstance(s, int) and MIN_SEED <= s <= MAX_SEED for s in seeds)
    assert len(set(seeds)) == 100
    assert any(s < 0 for s in seeds)
    assert any(s > 0 for s in seeds)
