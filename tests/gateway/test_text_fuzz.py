"""hypothesis against the gateway's text path with the real SmolLM2 tokenizer: random token
sequences through the incremental detokenizer, random stop strings through the matcher, and
both together as text_stream chains them. The streamed text is the whole sequence's text (so no
UTF-8 character is ever split), contains no stop string, and does not depend on where the token
boundaries fall. Bounded: SPLITSERVE_FUZZ_EXAMPLES examples per property (default 150)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway.api.detokenizer import IncrementalDetokenizer
from services.gateway.api.stop_strings import StopStringMatcher
from services.gateway.api.tokenizer import ModelTokenizer

EXAMPLES = int(os.environ.get("SPLITSERVE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
# Text with multi-byte characters, joiners and spaces: what splits across byte-level tokens.
TEXT = st.text(st.sampled_from(list("ab c\n.é東京🙂👍🏽\u200d日本語ß")), max_size=40)
SMALL_ALPHABET = st.text(st.sampled_from(list("abc é🙂")), max_size=30)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> ModelTokenizer:
    return ModelTokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def byte_tokens(tokenizer) -> list[int]:
    """Tokens of one byte >= 0x80: pieces of a multi-byte character, which land a sequence's
    end (or a prompt's) in the middle of one."""
    return [t for t in range(tokenizer.backend.get_vocab_size())
            if len(b := tokenizer.token_bytes(t)) == 1 and b[0] >= 0x80]


def _token_ids(tokenizer: ModelTokenizer, byte_tokens: list[int], max_size: int = 24):
    """Random ids over the whole vocabulary (byte tokens, merges, special tokens), ids of
    encoded text, and character pieces, mixed: the kinds of sequences a model can sample."""
    random_ids = st.lists(st.integers(0, tokenizer.backend.get_vocab_size() - 1),
                          max_size=max_size)
    encoded = TEXT.map(lambda t: tokenizer.encode(t, add_special_tokens=False)[:max_size])
    pieces = st.lists(st.sampled_from(byte_tokens), max_size=4)
    return st.one_of(random_ids, encoded, st.tuples(encoded, pieces, random_ids).map(
        lambda p: p[0] + p[1] + p[2]), st.tuples(pieces, encoded).map(lambda p: p[0] + p[1]))


def _streamed(tokenizer, prompt_ids, token_ids) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    return [detokenizer.push(t) for t in token_ids] + [detokenizer.flush()]


def _first_stop(text: str, stop: list[str]) -> int | None:
    """Where the output ends when `text` arrives one character at a time: before the stop
    string that is complete first (of two complete at once, the longer)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stop if s and text.startswith(s, end - len(s))
                  and end - len(s) >= 0]
        if starts:
            return min(starts)
    return None


def _chunks(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def test_streamed_text_is_the_whole_sequence_text(tokenizer, byte_tokens):
    """Also when the prompt (token ids, on /v1/completions) ends inside a character that the
    output's first bytes complete: the output's own text, no byte of it dropped."""
    @FUZZ
    @given(data=st.data())
    def check(data):
        token_ids = data.draw(_token_ids(tokenizer, byte_tokens))
        prompt_ids = data.draw(_token_ids(tokenizer, byte_tokens, max_size=6))
        assert "".join(_streamed(tokenizer, prompt_ids, token_ids)) == tokenizer.decode(token_ids)
    check()


def test_encoded_text_streams_back_with_no_split_character(tokenizer):
    @FUZZ
    @given(text=TEXT, prompt=TEXT)
    def check(text, prompt):
        ids = tokenizer.encode(text, add_special_tokens=False)
        deltas = _streamed(tokenizer, tokenizer.encode(prompt, add_special_tokens=False), ids)
        assert "".join(deltas) == tokenizer.decode(ids)
        assert not any("\ufffd" in d for d in deltas)
    check()


@FUZZ
@given(data=st.data(), text=SMALL_ALPHABET)
def test_stop_strings_never_reach_the_output_whatever_the_chunking(data, text):
    substrings = st.tuples(st.integers(0, len(text)), st.integers(1, 6)).map(
        lambda p: text[p[0]:p[0] + p[1]])
    stop = data.draw(st.lists(st.one_of(SMALL_ALPHABET.filter(bool), substrings), max_size=4))
    matcher = StopStringMatcher(stop)
    released = "".join(matcher.push(chunk) for chunk in _chunks(data.draw, text))
    released += matcher.flush()
    first = _first_stop(text, stop)
    assert not any(s and s in released for s in stop)
    assert released == (text if first is None else text[:first])
    assert matcher.stopped == (first is not None)


def test_detokenized_and_stopped_text_does_not_depend_on_token_boundaries(tokenizer,
                                                                          byte_tokens):
    """text_stream's chain: tokens -> detokenizer -> matcher. The result is the whole text cut
    before its first stop string, the same as if the text had arrived in one piece."""
    @FUZZ
    @given(data=st.data())
    def check(data):
        token_ids = data.draw(_token_ids(tokenizer, byte_tokens))
        text = tokenizer.decode(token_ids)
        substrings = st.tuples(st.integers(0, len(text)), st.integers(1, 4)).map(
            lambda p: text[p[0]:p[0] + p[1]])
        stop = data.draw(st.lists(st.one_of(substrings, TEXT.filter(bool)), max_size=3))
        detokenizer = IncrementalDetokenizer(tokenizer, ())
        matcher = StopStringMatcher(stop)
        out = []
        for token_id in token_ids:
            out.append(matcher.push(detokenizer.push(token_id)))
            if matcher.stopped:
                break
        if not matcher.stopped:
            out.append(matcher.push(detokenizer.flush()))
            out.append(matcher.flush())
        streamed = "".join(out)
        whole = StopStringMatcher(stop)
        at_once = whole.push(text) + whole.flush()
        assert streamed == at_once
        assert not any(s and s in streamed for s in stop)
    check()
