"""Batch invariance (``--batch-invariant on``; off by default): a row's logits, to the bit, depend only on
the model, its own prefix and its position.

On the default quantized path (the real SmolLM2 Q4_1 GGUF on nanoserve's kernels, float16 KV
cache) the same prompt's last-token logits are compared bit for bit when it is computed alone,
batched with 1, 7 and 63 other prompts of other lengths, prefilled in one step or in chunks of
1, 3, 16 and 100 tokens, with its first blocks from another sequence's KV (a prefix-cache hit),
decoded token by token against a one-step recompute (preemption), and at 1 and 2 threads.
Before this (``--batch-invariant off``) the 53-token prompt's logits moved by up to 0.16 when
batched with 7 others (its lm_head row then ran in a step of more than 4 rows: bf16 panels; since
the decode tiles take up to 8 rows, that takes 8 others)
and by 0.08 when prefilled in chunks of 1 or 3 tokens (the 16-bit decode body, and SDPA vs the
decode attention kernel).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nanoserve.engine import LLMEngine, SamplingParams, TokensPrompt
from nanoserve.engine.config import ModelConfig
from nanoserve.engine.model import kernels
from nanoserve.engine.model.batch_invariance import wants_batch_invariance
from nanoserve.engine.model.forward_batch import ForwardBatch, SeqSlice
from tests.engine.conftest import make_real_runner
from tests.engine.model.test_quantized_linear import gguf_dense, random_blocks

needs_kernels = pytest.mark.skipif(not kernels.load(), reason=f"kernels unavailable: {kernels.unavailable_reason()}")

BLOCKS_PER_SEQ = 8  # 128 tokens per sequence in the tests' 512 blocks of 16
PROMPT_LEN = 53


# ---- the kernel: every step size gives the decode path's bits ----


def _x(num_tokens: int, in_features: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, in_features, generator=gen) * torch.rand(num_tokens, 1, generator=gen) * 3
    x[3, 32:64] = 0.0  # a zero block
    x[5, 100] = 1e-35  # a block below the smallest scale: counts as zero
    return x


def _int16_one_row_at_a_time(
    quant_type: str, layout: str, rows: int, in_features: int, num_tokens: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [num_tokens, in_features], the weight blocks in ``layout``, the int16 product of each row of x alone)."""
    blocks = random_blocks(quant_type, rows, in_features, seed=seed).blocks
    if layout == "groups":
        blocks = kernels.group_rows(blocks, quant_type, in_features)
    x = _x(num_tokens, in_features)
    one_by_one = torch.cat(
        [
            kernels.gguf_linear(x[i : i + 1], blocks, quant_type, in_features, isa="int16", layout=layout)
            for i in range(num_tokens)
        ]
    )
    return x, blocks, one_by_one


@needs_kernels
@pytest.mark.parametrize(
    ("quant_type", "layout", "rows", "in_features"),
    [("Q4_1", "groups", 1540, 576), ("Q4_0", "groups", 200, 576), ("Q4_0", "rows", 45, 576),
     ("Q8_0", "rows", 1001, 576), ("Q4_1", "rows", 36, 1536)],
)  # fmt: skip
def test_int16_rows_do_not_depend_on_the_step_size(quant_type, layout, rows, in_features):
    x, blocks, one_by_one = _int16_one_row_at_a_time(quant_type, layout, rows, in_features, 70, seed=5)
    for num_tokens in (2, 3, 4, 5, 6, 7, 13, 64, 70):
        got = kernels.gguf_linear(x[:num_tokens], blocks, quant_type, in_features, isa="int16", layout=layout)
        assert torch.equal(got, one_by_one[:num_tokens]), num_tokens
    # the AVX2 tiles (what a CPU without AVX-512 runs, four rows at a time) give the same bits
    avx2 = kernels.gguf_linear(x, blocks, quant_type, in_features, isa="int16_avx2", layout=layout)
    assert torch.equal(avx2, one_by_one)
    # and the decode path up to 4 rows is the same arithmetic under every isa
    assert torch.equal(kernels.gguf_linear(x[:4], blocks, quant_type, in_features, layout=layout), one_by_one[:4])


@needs_kernels
@pytest.mark.parametrize(
    ("quant_type", "layout", "rows", "in_features"),
    [("Q4_1", "groups", 52, 128), ("Q4_0", "groups", 100, 160), ("Q4_0", "rows", 45, 128),
     ("Q8_0", "rows", 33, 160), ("Q4_1", "rows", 70, 128)],
)  # fmt: skip
def test_int16_every_step_from_9_to_40_rows_gives_the_one_row_bits(quant_type, layout, rows, in_features):
    # every step size a tiling of x rows can split differently: the AVX-512 int16 panels' whole
    # tiles and every remainder, the decode tiles' groups of 8 (AVX2: 4) rows and their remainders;
    # weight rows not a multiple of a panel's 32 (or a tile's) leave a partial one
    x, blocks, one_by_one = _int16_one_row_at_a_time(quant_type, layout, rows, in_features, 40, seed=8)
    for num_tokens in range(9, 41):
        got = kernels.gguf_linear(x[:num_tokens], blocks, quant_type, in_features, isa="int16", layout=layout)
        assert torch.equal(got, one_by_one[:num_tokens]), num_tokens


@needs_kernels
@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_int16_large_steps_are_x_times_gguf_weights_to_16_bit_activations(quant_type):
    weight = random_blocks(quant_type, 64, 256, seed=6)
    x = _x(40, 256)
    got = kernels.gguf_linear(x, weight.blocks, quant_type, 256, isa="int16")
    exact = x.double() @ gguf_dense(weight).double().T
    # 16-bit activations: each element within 2^-16 of its block's largest, relative
    bound = (x.abs().view(40, 8, 32).amax(-1).repeat_interleave(32, 1).double() * 2.0**-15) @ gguf_dense(
        weight
    ).abs().double().T
    assert ((got.double() - exact).abs() <= bound + 1e-5).all()


@needs_kernels
def test_int16_nan_input_gives_nan_outputs_not_numbers():
    weight = random_blocks("Q4_1", 32, 64, seed=7)
    x = torch.ones(6, 64)
    x[2, 10] = float("nan")
    y = kernels.gguf_linear(x, weight.blocks, "Q4_1", 64, isa="int16")
    assert y[2].isnan().all()
    assert not y[[0, 1, 3, 4, 5]].isnan().any()


# ---- the setting ----


@needs_kernels
def test_auto_is_on_only_where_the_int16_panels_keep_large_steps_fast():
    assert wants_batch_invariance("auto", on_gguf_kernels=True) == kernels.has_int16_panels()
    assert not wants_batch_invariance("auto", on_gguf_kernels=False)  # dense or torch kernels: nothing to gain
    assert wants_batch_invariance("on", on_gguf_kernels=False)
    assert not wants_batch_invariance("off", on_gguf_kernels=True)


def test_config_refuses_an_unknown_batch_invariant_mode():
    with pytest.raises(ValueError, match=r"batch_invariant must be one of \('auto', 'on', 'off'\), got 'yes'"):
        ModelConfig(batch_invariant="yes")


# ---- the real model: logits of one prompt however it is computed ----


@pytest.fixture(scope="module")
def runner():
    """The default GGUF on the default path: quantization auto, float16 KV cache; batch_invariant on (what auto
    picks on a CPU with AVX-512 VNNI; elsewhere the decode tiles run large steps: the same bits)."""
    return make_real_runner(batch_invariant="on")


@pytest.fixture(scope="module")
def prompt(runner) -> list[int]:
    text = "The quick brown fox jumps over the lazy dog. " * 8
    return runner.tokenizer.encode(text)[:PROMPT_LEN]


def _table(seq: int) -> list[int]:
    return list(range(seq * BLOCKS_PER_SEQ, (seq + 1) * BLOCKS_PER_SEQ))


def _forward(runner, slices: list[SeqSlice]) -> torch.Tensor:
    return runner.forward(ForwardBatch.build(slices, runner.block_size))


def _alone(runner, prompt: list[int], seq: int = 0) -> torch.Tensor:
    return _forward(runner, [SeqSlice(prompt, 0, _table(seq))])[0]


@pytest.fixture(scope="module")
def alone(runner, prompt) -> torch.Tensor:
    return _alone(runner, prompt)


def _other(i: int, length: int | None = None) -> list[int]:
    """Another request's prompt: ``length`` tokens, by default 2 .. 31 (never the prompt's 53; 63 of them
    make a step of about 1,000 rows)."""
    length = 2 + (i * 37) % 30 if length is None else length
    return [(i * 131 + j * 7) % 5000 + 100 for j in range(length)]


def test_without_batch_invariance_the_same_prompt_gets_other_logits(prompt):
    # the reproduction: --batch-invariant off (bf16 panels beyond 8 rows, SDPA prefill) moves the logits;
    # with 8 others the lm_head runs 9 rows (up to 8 take the decode tiles, whose bits do not move)
    variant = make_real_runner(batch_invariant="off")
    assert variant.batch_invariance.startswith("none")
    whole = _alone(variant, prompt)
    batched = _forward(
        variant, [SeqSlice(_other(i), 0, _table(i + 1)) for i in range(8)] + [SeqSlice(prompt, 0, _table(0))]
    )
    for start in range(0, len(prompt), 3):
        chunked = _forward(variant, [SeqSlice(prompt[start : start + 3], start, _table(9), start + 3 >= len(prompt))])
    assert (batched[-1] - whole).abs().max() > 1e-3
    assert (chunked[0] - whole).abs().max() > 1e-3


def test_the_default_path_states_its_guarantee(runner):
    assert runner.batch_invariance.startswith("bitwise")
    assert runner.model.lm_head.isa == "int16"


@pytest.mark.parametrize("num_others", [1, 7, 63])
def test_logits_bit_identical_alone_and_batched_with_others(runner, prompt, alone, num_others):
    others = [SeqSlice(_other(i), 0, _table(i + 1)) for i in range(num_others)]
    middle = num_others // 2
    logits = _forward(runner, [*others[:middle], SeqSlice(prompt, 0, _table(0)), *others[middle:]])
    assert torch.equal(logits[middle], alone)


@pytest.mark.parametrize("chunk", [1, 3, 16, 100])
def test_logits_bit_identical_prefilled_in_one_step_or_in_chunks(runner, prompt, alone, chunk):
    for start in range(0, len(prompt), chunk):
        piece = prompt[start : start + chunk]
        logits = _forward(runner, [SeqSlice(piece, start, _table(1), start + chunk >= len(prompt))])
    assert torch.equal(logits[0], alone)


def test_logits_bit_identical_with_the_prefix_from_the_cache(runner, prompt, alone):
    _alone(runner, prompt, seq=2)  # another request computed the prompt: its first 3 full blocks are cached
    shared = _table(2)[:3] + _table(3)[3:]  # a prefix-cache hit: those blocks, then the request's own
    cached = 3 * runner.block_size
    logits = _forward(runner, [SeqSlice(prompt[cached:], cached, shared)])
    assert torch.equal(logits[0], alone)


def test_decode_logits_equal_a_recompute_after_preemption(runner, prompt):
    # decode 6 tokens greedily beside another decoding sequence, then recompute prompt + output in one step
    # (what a preempted request does) and in chunks of 16: the last logits agree to the bit
    other = _other(3)
    first = _forward(runner, [SeqSlice(prompt, 0, _table(0)), SeqSlice(other, 0, _table(1))])
    tokens, other_tokens = [int(first[0].argmax())], [int(first[1].argmax())]
    for _ in range(5):
        seq = len(prompt) + len(tokens) - 1
        step = _forward(
            runner,
            [
                SeqSlice(tokens[-1:], seq, _table(0)),
                SeqSlice(other_tokens[-1:], len(other) + len(other_tokens) - 1, _table(1)),
            ],
        )
        tokens.append(int(step[0].argmax()))
        other_tokens.append(int(step[1].argmax()))
    decoded = step[0]
    history = prompt + tokens[:-1]
    assert torch.equal(_alone(runner, history, seq=4), decoded)
    for start in range(0, len(history), 16):
        logits = _forward(runner, [SeqSlice(history[start : start + 16], start, _table(5), start + 16 >= len(history))])
    assert torch.equal(logits[0], decoded)


def test_logits_bit_identical_at_one_and_two_threads(runner, prompt, alone):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = _alone(runner, prompt, seq=6)
        batched = _forward(runner, [SeqSlice(_other(9), 0, _table(7)), SeqSlice(prompt, 0, _table(6))])[1]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(two, alone)
    assert torch.equal(batched, alone)


# ---- seeded sampling: the same tokens uncached, cached, batched, preempted and resumed ----

SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)


def _generate(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], tag: str, num_prior: int = 0
) -> list:
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"{tag}{i}", TokensPrompt(p, num_prior_output_tokens=num_prior), sp)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return [finals[f"{tag}{i}"] for i in range(len(prompts))]


def test_seeded_sampling_same_tokens_uncached_cached_batched_and_preempted(runner, prompt):
    engine = LLMEngine(runner.config, runner=runner)
    (uncached,) = _generate(engine, [prompt], [SEEDED], "uncached")
    (cached,) = _generate(engine, [prompt], [SEEDED], "cached")
    assert cached.metrics.num_cached_tokens > 0
    assert cached.token_ids == uncached.token_ids
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    others = [[*_other(i)[:40], i + 200] for i in range(7)]
    batched = _generate(engine, [*others[:3], prompt, *others[3:]], [greedy] * 3 + [SEEDED] + [greedy] * 4, "batch")
    assert batched[3].token_ids == uncached.token_ids
    # resumed as after a crash: re-admitted with the 6 tokens already sent, recomputed in one prefill
    resume_params = dataclasses.replace(SEEDED, max_tokens=10)
    (resumed,) = _generate(engine, [prompt + uncached.token_ids[:6]], [resume_params], "resumed", num_prior=6)
    assert resumed.token_ids == uncached.token_ids[6:]

    small = make_real_runner(
        num_kv_blocks=12, enable_prefix_caching=False, batch_invariant="on"
    )  # 192 slots: 4 requests need ~270
    small_engine = LLMEngine(small.config, runner=small)
    crowd = [prompt, *(_other(i, 50) for i in range(1, 4))]
    preempted = _generate(small_engine, crowd, [SEEDED] * 4, "small")
    assert sum(o.metrics.num_preemptions for o in preempted) > 0
    assert preempted[0].token_ids == uncached.token_ids
