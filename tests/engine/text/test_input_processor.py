"""InputProcessor: every content check of a request, with the field at fault and the limit.

The tokenizer is SmolLM2's real one; the limits are a small ModelInfo.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.engine.core.status import ModelInfo
from nanoserve.engine.errors import InvalidRequestError
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.text.input_processor import InputProcessor
from nanoserve.engine.text.prompts import ChatPrompt, TokensPrompt
from nanoserve.engine.text.tokenizer import Tokenizer

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_path(tiny_model_dir)


def _processor(tokenizer: Tokenizer, max_model_len: int = MAX_MODEL_LEN, num_blocks: int = 1024) -> InputProcessor:
    info = ModelInfo(
        model_name="tiny",
        dtype="float32",
        device="cpu",
        max_model_len=max_model_len,
        block_size=16,
        num_blocks=num_blocks,
        vocab_size=49152,
        has_chat_template=True,
        eos_token_ids=(2,),
        max_prompt_bytes=1023 * tokenizer.max_token_bytes,
    )
    return InputProcessor(tokenizer, info)


def _error(processor: InputProcessor, prompt: object, params: SamplingParams | None = None) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        processor.process("r", prompt, params)  # type: ignore[arg-type]
    return info.value


def test_a_prompt_too_long_by_itself_is_named_as_the_prompt_not_max_tokens(tokenizer: Tokenizer) -> None:
    """Issue 8, fault 4: 600,001 prompt tokens with max_tokens 1."""
    error = _error(_processor(tokenizer), TokensPrompt([42] * 600_001), SamplingParams(max_tokens=1))
    assert error.field == "prompt_token_ids"
    assert str(error) == (
        "prompt_token_ids: prompt has 600001 tokens; at most 1023 leave room for one generated token "
        "(max_model_len 1024, KV pool 16384 tokens)"
    )


def test_a_text_prompt_too_long_by_itself_is_named_as_the_prompt(tokenizer: Tokenizer) -> None:
    error = _error(_processor(tokenizer), "word " * 1500, SamplingParams(max_tokens=1))
    assert error.field == "prompt"
    assert "prompt has 1501 tokens; at most 1023" in str(error)


def test_a_long_text_is_refused_from_a_prefix_without_tokenizing_the_rest(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the length bound (50,000 bytes may be 1023 tokens of 81 bytes) but ordinary words: the first
    8 characters per allowed token are already too many tokens, so the rest is never tokenized."""
    encoded: list[int] = []
    real_encode = tokenizer.encode

    def counting_encode(text: str, *args: object, **kwargs: object) -> list[int]:
        encoded.append(len(text))
        return real_encode(text)

    monkeypatch.setattr(tokenizer, "encode", counting_encode)
    text = "word " * 10_000
    error = _error(_processor(tokenizer), text)
    assert encoded == [8309]  # cut before the last space of the first 8 * (1023 + 16) = 8,312 characters
    assert str(error) == (
        "prompt: prompt has more than 1023 tokens (its first 8309 characters alone are 1662 tokens); at most "
        "1023 leave room for one generated token (max_model_len 1024, KV pool 16384 tokens)"
    )


def test_a_prompt_that_fits_makes_max_tokens_the_field_at_fault(tokenizer: Tokenizer) -> None:
    error = _error(_processor(tokenizer), TokensPrompt([42] * 1000), SamplingParams(max_tokens=100))
    assert (error.field, str(error)) == (
        "max_tokens",
        "max_tokens: prompt (1000 tokens) + max_tokens (100) = 1100 exceeds max_model_len (1024)",
    )


def test_a_huge_text_is_refused_from_its_length_without_tokenizing(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 8, fault 3: a 3 MB prompt costs a length check, not a tokenization."""

    def no_encode(*_: object, **__: object) -> list[int]:
        raise AssertionError("a prompt this long must be refused before it is tokenized")

    monkeypatch.setattr(tokenizer, "encode", no_encode)
    monkeypatch.setattr(tokenizer, "apply_chat_template", no_encode)
    processor = _processor(tokenizer)
    text = "x" * (3 * 1024 * 1024)
    error = _error(processor, text)
    bound = -(-len(text) // tokenizer.max_token_bytes)
    assert str(error) == (
        f"prompt: {len(text)} bytes of text are at least {bound} tokens; a prompt may have at most 1023 tokens "
        "(max_model_len 1024, KV pool 16384 tokens, one token left to generate)"
    )
    chat = _error(processor, ChatPrompt([{"role": "user", "content": text}]))
    assert chat.field == "messages"


def test_the_length_bound_never_refuses_a_prompt_that_fits(tokenizer: Tokenizer) -> None:
    """The longest vocabulary entry repeated 1000 times: ~80 bytes a token, tokenized and accepted."""
    longest_id = max(range(tokenizer.vocab_size), key=lambda i: len(tokenizer.decode([i]).encode()))
    text = tokenizer.decode([longest_id]) * 1000
    assert len(text.encode()) > 900 * tokenizer.max_token_bytes  # close to the bound of 1023 tokens
    request = _processor(tokenizer).process("r", text, SamplingParams(max_tokens=1))
    assert request.num_prompt_tokens == len(tokenizer.encode(text)) <= 1023


def test_token_ids_outside_the_vocabulary_name_their_index(tokenizer: Tokenizer) -> None:
    error = _error(_processor(tokenizer), TokensPrompt([1, 49152]))
    assert str(error) == "prompt_token_ids[1]: token id 49152 outside the vocabulary [0, 49152)"


def test_unknown_chat_role_names_the_message(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]
    error = _error(_processor(tokenizer), ChatPrompt(messages))
    assert str(error) == "messages[1].role: unknown role 'wizard'; known roles: system, user, assistant"


def test_stop_token_id_outside_the_vocabulary_names_its_index(tokenizer: Tokenizer) -> None:
    error = _error(_processor(tokenizer), "hi", SamplingParams(stop_token_ids=[5, 60000]))
    assert str(error) == "stop_token_ids[1]: token id 60000 outside the vocabulary [0, 49152)"


def test_request_id_too_long(tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="request_id: at most 128 characters, got 129"):
        _processor(tokenizer).process("x" * 129, "hi")


def test_empty_inputs_name_their_field(tokenizer: Tokenizer) -> None:
    processor = _processor(tokenizer)
    assert str(_error(processor, "")) == "prompt: is empty (0 tokens)"
    assert str(_error(processor, TokensPrompt([]))) == "prompt_token_ids: is empty (0 tokens)"
    assert str(_error(processor, ChatPrompt([]))) == "messages: must hold at least one message"


def test_the_default_max_tokens_is_clamped_to_the_room_the_prompt_leaves(tokenizer: Tokenizer) -> None:
    """Issue 29, item 6: 8,191 prompt ids and no max_tokens were refused, naming max_tokens."""
    processor = _processor(tokenizer)
    assert processor.process("a", TokensPrompt(prompt_token_ids=[5] * 10)).max_tokens == 16
    assert processor.process("b", TokensPrompt(prompt_token_ids=[5] * 1020), SamplingParams()).max_tokens == 4
    assert processor.process("c", TokensPrompt(prompt_token_ids=[5] * 1023), SamplingParams()).max_tokens == 1
    assert (
        processor.process("d", TokensPrompt(prompt_token_ids=[5] * 1020), SamplingParams(max_tokens=None)).max_tokens
        == 4
    )


def test_a_given_max_tokens_that_does_not_fit_is_refused_even_when_it_equals_the_default(
    tokenizer: Tokenizer,
) -> None:
    params = SamplingParams(max_tokens=16)
    assert not params.max_tokens_is_default
    assert SamplingParams().max_tokens_is_default
    error = _error(_processor(tokenizer), TokensPrompt(prompt_token_ids=[5] * 1020), params)
    assert str(error) == "max_tokens: prompt (1020 tokens) + max_tokens (16) = 1036 exceeds max_model_len (1024)"


def test_a_prompt_that_leaves_no_room_is_named_as_the_prompt_with_the_default_max_tokens(tokenizer: Tokenizer) -> None:
    error = _error(_processor(tokenizer), TokensPrompt(prompt_token_ids=[5] * 1024))
    assert error.field == "prompt_token_ids"
    assert str(error).startswith("prompt_token_ids: prompt has 1024 tokens; at most 1023 leave room")


def test_counting_the_tokens_of_an_empty_text_names_the_text(tokenizer: Tokenizer) -> None:
    """Issue 29, item 4: Tokenize {text: ""} answered OK with no tokens."""
    with pytest.raises(InvalidRequestError) as info:
        _processor(tokenizer).tokenize("", text_field="text", as_prompt=False)
    assert str(info.value) == "text: is empty (0 tokens)"


def test_request_id_with_a_nul_is_refused_before_tokenizing(tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError) as info:
        _processor(tokenizer).process("req\x00", "hi")
    assert str(info.value) == (
        "request_id: must hold no control characters or surrogates: control character U+0000 at index 3"
    )
