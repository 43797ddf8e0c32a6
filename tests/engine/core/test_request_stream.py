"""A request's streamed outputs with SmolLM2's real tokenizer: UTF-8 and stop strings.

Tokens are fed as if sampled, so the text is known exactly; the tokenizer is
the real one (byte-level BPE: an emoji or a CJK character spans several tokens).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.engine.core.request import Request
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.text.tokenizer import Tokenizer

TEXT = "Hi 😀 世界, naïve café 🦊!"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_path(tiny_model_dir)


def _feed(tokenizer: Tokenizer, token_ids: list[int], params: SamplingParams) -> tuple[Request, list]:
    request = Request("r", [1], params, max_tokens=params.max_tokens or 100, eos_token_ids=[2], decoder=tokenizer)
    outputs = []
    for token_id in token_ids:
        request.append_token(token_id, None)
        output = request.make_output(final=request.finish_reason is not None)
        if output is not None:
            outputs.append(output)
        if request.finish_reason is not None:
            break
    return request, outputs


def test_emoji_and_cjk_stream_whole_characters(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(TEXT)
    assert len(token_ids) > len(TEXT.split())  # characters do span tokens
    _, outputs = _feed(tokenizer, token_ids, SamplingParams(max_tokens=len(token_ids)))
    deltas = [o.delta_text for o in outputs]
    assert "".join(deltas) == TEXT == outputs[-1].text
    assert all("\ufffd" not in d for d in deltas)
    assert [t for o in outputs for t in o.delta_token_ids] == token_ids
    for output in outputs:  # released tokens decode to exactly the released text
        assert tokenizer.decode(output.token_ids) == output.text


def test_stop_string_inside_a_cjk_run_is_cut_before_it(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(TEXT)
    request, outputs = _feed(tokenizer, token_ids, SamplingParams(max_tokens=len(token_ids), stop=["界,"]))
    assert (request.finish_reason, request.stop_reason) == ("stop", "界,")
    assert outputs[-1].text == "".join(o.delta_text for o in outputs) == "Hi 😀 世"


def test_eos_ends_with_stop_and_adds_no_text(tokenizer: Tokenizer) -> None:
    token_ids = [*tokenizer.encode("Hello"), 2]
    request, outputs = _feed(tokenizer, token_ids, SamplingParams(max_tokens=10))
    # the model's own EOS is no stop token the client asked for: stop_reason stays unset
    assert (request.finish_reason, request.stop_reason) == ("stop", None)
    assert outputs[-1].text == "Hello"
    assert outputs[-1].token_ids == token_ids


def test_eos_with_other_stop_token_ids_still_reports_no_stop_token(tokenizer: Tokenizer) -> None:
    """Issue 8, fault 7: with stop_token_ids [0], an EOS (2) must not look like a stop token."""
    token_ids = [*tokenizer.encode("Hello"), 2]
    request, _ = _feed(tokenizer, token_ids, SamplingParams(max_tokens=10, stop_token_ids=[0]))
    assert (request.finish_reason, request.stop_reason) == ("stop", None)


def test_a_stop_token_id_the_client_asked_for_is_reported(tokenizer: Tokenizer) -> None:
    token_ids = [*tokenizer.encode("Hello"), 0]
    request, _ = _feed(tokenizer, token_ids, SamplingParams(max_tokens=10, stop_token_ids=[0]))
    assert (request.finish_reason, request.stop_reason) == ("stop", 0)


def test_eos_listed_in_stop_token_ids_is_reported_as_asked(tokenizer: Tokenizer) -> None:
    token_ids = [*tokenizer.encode("Hello"), 2]
    request, _ = _feed(tokenizer, token_ids, SamplingParams(max_tokens=10, stop_token_ids=[2]))
    assert (request.finish_reason, request.stop_reason) == ("stop", 2)


def test_ignore_eos_keeps_going(tokenizer: Tokenizer) -> None:
    token_ids = [*tokenizer.encode("Hello"), 2, *tokenizer.encode(" there")]
    request, outputs = _feed(tokenizer, token_ids, SamplingParams(max_tokens=len(token_ids), ignore_eos=True))
    assert request.finish_reason == "length"
    assert outputs[-1].text == "Hello there"  # the special token has no text
