"""Paged attention on the tiny random model (float32): the block layout must not change the math.

Each test computes the same logits two ways through ``ModelRunner.forward`` and
requires them equal within ATOL. Block size is 4, so a 23-token prompt spans 6 blocks.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine.model.attention import TorchAttentionBackend
from nanoserve.engine.model.forward_batch import ForwardBatch, SeqSlice

ATOL = 1e-5  # float32, same kernels; only summation order may differ
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def runner(tiny_runner_factory):
    return tiny_runner_factory(num_kv_blocks=128, block_size=BLOCK_SIZE)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def forward(runner, slices: list[SeqSlice]) -> torch.Tensor:
    return runner.forward(ForwardBatch.build(slices, BLOCK_SIZE, runner.device))


def prefill_then_decode(runner, tokens: list[int], block_ids: list[int], num_decodes: int) -> torch.Tensor:
    """Logits [1 + num_decodes, vocab]: the prefill's last position, then each decode (fed argmax)."""
    rows = [forward(runner, [SeqSlice(tokens, 0, block_ids)])[0]]
    for step in range(num_decodes):
        rows.append(forward(runner, [SeqSlice([int(rows[-1].argmax())], len(tokens) + step, block_ids)])[0])
    return torch.stack(rows)


def test_scattered_blocks_give_contiguous_logits(runner):
    tokens = prompt(23, seed=1)
    contiguous = prefill_then_decode(runner, tokens, list(range(8)), num_decodes=6)
    scattered = prefill_then_decode(runner, tokens, [97, 12, 55, 8, 120, 33, 71, 100], num_decodes=6)
    torch.testing.assert_close(scattered, contiguous, atol=ATOL, rtol=0)


def test_batch_of_different_lengths_matches_each_alone(runner):
    prompts = [prompt(n, seed=n) for n in (5, 17, 9)]
    tables = [[10, 11, 12], [20, 21, 22, 23, 24, 25], [30, 31, 32, 33]]
    alone = [
        prefill_then_decode(runner, p, [b + 40 for b in t], num_decodes=3) for p, t in zip(prompts, tables, strict=True)
    ]

    batched = [forward(runner, [SeqSlice(p, 0, t) for p, t in zip(prompts, tables, strict=True)])]
    for step in range(3):
        slices = [
            SeqSlice([int(a[step].argmax())], len(p) + step, t) for p, t, a in zip(prompts, tables, alone, strict=True)
        ]
        batched.append(forward(runner, slices))
    for i, expected in enumerate(alone):
        torch.testing.assert_close(torch.stack([b[i] for b in batched]), expected, atol=ATOL, rtol=0)


def test_chunked_prefill_matches_one_shot(runner):
    tokens = prompt(30, seed=7)
    one_shot = forward(runner, [SeqSlice(tokens, 0, list(range(8)))])
    blocks = list(range(8, 16))
    forward(runner, [SeqSlice(tokens[:7], 0, blocks, needs_logits=False)])
    forward(runner, [SeqSlice(tokens[7:19], 7, blocks, needs_logits=False)])
    chunked = forward(runner, [SeqSlice(tokens[19:], 19, blocks)])
    torch.testing.assert_close(chunked, one_shot, atol=ATOL, rtol=0)


def test_decode_after_prefill_matches_prefill_of_whole_sequence(runner):
    tokens = prompt(13, seed=3)
    whole = forward(runner, [SeqSlice(tokens, 0, [60, 61, 62, 63])])
    forward(runner, [SeqSlice(tokens[:-1], 0, [64, 65, 66, 67])])
    decoded = forward(runner, [SeqSlice(tokens[-1:], 12, [64, 65, 66, 67])])
    torch.testing.assert_close(decoded, whole, atol=ATOL, rtol=0)


def test_mixed_batch_of_prefills_and_decodes_matches_each_alone(runner):
    a, b, c = prompt(11, seed=11), prompt(14, seed=12), prompt(6, seed=13)
    ta, tb, tc = [70, 71, 72, 73], [74, 75, 76, 77], [78, 79]
    forward(runner, [SeqSlice(a[:-1], 0, ta)])  # a: cached, decodes its last token
    forward(runner, [SeqSlice(b[:5], 0, tb, needs_logits=False)])  # b: chunk 2 of its prompt
    mixed = forward(runner, [SeqSlice(b[5:], 5, tb), SeqSlice(a[-1:], 10, ta), SeqSlice(c, 0, tc)])
    alone = forward(runner, [SeqSlice(a, 0, [80, 81, 82])])
    alone = torch.cat([forward(runner, [SeqSlice(b, 0, [83, 84, 85, 86])]), alone])
    alone = torch.cat([alone, forward(runner, [SeqSlice(c, 0, [87, 88])])])
    torch.testing.assert_close(mixed, alone, atol=ATOL, rtol=0)


def test_decode_batch_reads_only_each_sequences_own_blocks(runner):
    # Two sequences whose blocks interleave in the pool: a leak across block tables shows up here.
    p, q = prompt(9, seed=21), prompt(9, seed=22)
    tp, tq = [90, 92, 94], [91, 93, 95]
    forward(runner, [SeqSlice(p[:-1], 0, tp), SeqSlice(q[:-1], 0, tq)])
    both = forward(runner, [SeqSlice(p[-1:], 8, tp), SeqSlice(q[-1:], 8, tq)])
    expected = torch.cat(
        [forward(runner, [SeqSlice(p, 0, [96, 97, 98])]), forward(runner, [SeqSlice(q, 0, [99, 101, 102])])]
    )
    torch.testing.assert_close(both, expected, atol=ATOL, rtol=0)


def test_decode_batch_of_very_different_contexts_matches_each_alone(runner):
    # contexts 3 .. 70 tokens (1 .. 18 blocks), unsorted: decodes are split into buckets by length
    lengths = (40, 3, 70, 9, 21)
    prompts = [prompt(n, seed=100 + n) for n in lengths]
    tables, next_block = [], 0
    for n in lengths:
        tables.append(list(range(next_block, next_block + -(-(n + 1) // BLOCK_SIZE))))
        next_block += len(tables[-1])
    alone = torch.cat(
        [forward(runner, [SeqSlice(p, 0, [b + next_block for b in t])]) for p, t in zip(prompts, tables, strict=True)]
    )
    forward(runner, [SeqSlice(p[:-1], 0, t, needs_logits=False) for p, t in zip(prompts, tables, strict=True)])
    slices = [SeqSlice(p[-1:], len(p) - 1, t) for p, t in zip(prompts, tables, strict=True)]
    decodes = ForwardBatch.build(slices, BLOCK_SIZE, runner.device)
    assert len(TorchAttentionBackend().prepare(decodes, BLOCK_SIZE).decode_buckets) > 1
    torch.testing.assert_close(runner.forward(decodes), alone, atol=ATOL, rtol=0)
