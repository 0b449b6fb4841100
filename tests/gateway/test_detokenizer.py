"""Incremental detokenization: one token at a time, the text comes out whole: multi-byte
characters split across tokens are held until complete, and no space is lost."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.gateway.api.detokenizer import IncrementalDetokenizer
from services.gateway.api.tokenizer import ModelTokenizer

TEXTS = [
    "Ünïcödé text: 東京, Москва, Αθήνα, القاهرة, 🙂 🚀 ✨",
    "Café au lait, crème brûlée, Zürich, Łódź.",
    "日本語のテキストと한국어 텍스트",
    "Family: 👩‍👩‍👧‍👦 flags: 🇫🇷🇯🇵 skin: 👍🏽",
    "Tabs\tand  double  spaces\n\nnew lines   stay.",
    " leading space, trailing space ",
]


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tokenizer(request, tiny_llama_dir) -> ModelTokenizer:
    if request.param == "tiny":
        return ModelTokenizer(tiny_llama_dir)
    return ModelTokenizer(request.getfixturevalue("smollm2_dir"))


def _stream(tokenizer, token_ids, prompt_ids=()) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, list(prompt_ids))
    deltas = [detokenizer.push(t) for t in token_ids]
    deltas.append(detokenizer.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_text_and_never_split_a_character(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(tokenizer, ids, prompt_ids=tokenizer.encode("Say:"))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_a_character_split_over_byte_tokens_is_held_until_complete(tiny_llama_dir):
    tokenizer = ModelTokenizer(tiny_llama_dir)
    ids = tokenizer.encode("東", add_special_tokens=False)
    assert len(ids) > 1, "the tiny tokenizer should split this CJK character into bytes"
    deltas = _stream(tokenizer, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == "東" and deltas[-1] == ""


def test_incomplete_character_at_the_end_is_flushed_as_the_full_decode_has_it(tiny_llama_dir):
    tokenizer = ModelTokenizer(tiny_llama_dir)
    partial = tokenizer.encode("東", add_special_tokens=False)[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.push(t) for t in partial] == [""] * len(partial)
    assert detokenizer.flush() == tokenizer.decode(partial)


def test_special_tokens_are_skipped(tiny_llama_dir):
    tokenizer = ModelTokenizer(tiny_llama_dir)
    eos = tokenizer.backend.token_to_id("<|im_end|>")
    ids = tokenizer.encode("Hello", add_special_tokens=False) + [eos]
    assert "".join(_stream(tokenizer, ids)) == "Hello"


def test_leading_space_survives_a_decoder_that_strips_it_from_the_first_token(tmp_path):
    # SentencePiece-style (Metaspace) decoders drop the space of a sequence's first token;
    # decoding with the prompt's last tokens as context keeps " world" a word apart.
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.train_from_iterator(["Hello world, hello there world"] * 20,
                                trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"],
                                                    show_progress=False))
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = ModelTokenizer(tmp_path)
    prompt = tokenizer.encode("Hello")
    output = tokenizer.encode("Hello world")[len(prompt):]
    assert tokenizer.decode(output) == "world"  # what token-by-token decoding would give
    assert "".join(_stream(tokenizer, output, prompt_ids=prompt)) == " world"


def _wordpiece_with_added_tokens(tmp_path) -> ModelTokenizer:
    """A WordPiece decoder, which puts a space between adjacent added tokens."""
    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2, "##s": 3},
                                         unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(["<a>", "<b>"])
    backend.add_tokens(["<tool>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    return ModelTokenizer(tmp_path)


def test_spaces_between_special_tokens_false_joins_adjacent_added_tokens(tmp_path):
    """vLLM's rule: with special tokens kept, an added token right after another is written
    as its own text, so no space comes between them; the other spaces stay."""
    tokenizer = _wordpiece_with_added_tokens(tmp_path)
    a, b, tool, hello, world = (tokenizer.backend.token_to_id(t)
                                for t in ("<a>", "<b>", "<tool>", "hello", "world"))
    output = [hello, a, b, tool, world, hello, a, b]

    def text(spaces: bool, skip: bool = False) -> str:
        detokenizer = IncrementalDetokenizer(tokenizer, [world], skip_special_tokens=skip,
                                             spaces_between_special_tokens=spaces)
        return "".join([detokenizer.push(t) for t in output] + [detokenizer.flush()])

    assert text(spaces=True) == " hello <a> <b> <tool> world hello <a> <b>"
    assert text(spaces=False) == " hello <a><b><tool> world hello <a><b>"
    # Without special tokens there is nothing to join (vLLM ignores the field then).
    assert text(spaces=False, skip=True) == text(spaces=True, skip=True) == (
        " hello <tool> world hello")


def test_spaces_between_special_tokens_changes_nothing_for_smollm2(smollm2_dir):
    tokenizer = ModelTokenizer(smollm2_dir)
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi"}]) + [0, 1, 2, 1, 0]
    texts = []
    for spaces in (True, False):
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False,
                                             spaces_between_special_tokens=spaces)
        texts.append("".join([detokenizer.push(t) for t in ids] + [detokenizer.flush()]))
    assert texts[0] == texts[1] == tokenizer.decode(ids, skip_special_tokens=False)


def test_token_bytes_reassemble_the_text(tokenizer):
    text = TEXTS[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(t) for t in ids).decode() == text


def _byte_token(tokenizer: ModelTokenizer, value: int) -> int:
    return next(t for t in range(tokenizer.backend.get_vocab_size())
                if tokenizer.token_bytes(t) == bytes([value]))


def test_stray_bytes_stream_at_once_instead_of_holding_the_rest_of_the_output(smollm2_dir):
    # A model can sample byte tokens that no continuation makes a character (greedy
    # completions of random-word prompts did: 128 tokens of U+FFFD). Each is final text: held
    # as "incomplete", the whole output came in one event at its end.
    tokenizer = ModelTokenizer(smollm2_dir)
    stray = _byte_token(tokenizer, 0x80)  # a continuation byte with no first byte before it
    hello = tokenizer.encode(" hello", add_special_tokens=False)
    ids = hello + [stray] * 5 + hello
    deltas = _stream(tokenizer, ids)
    assert all(deltas[:-1]), "every token's text went out with it"
    assert "".join(deltas) == tokenizer.decode(ids)


def test_a_first_byte_is_held_until_the_next_byte_shows_it_complete_or_broken(smollm2_dir):
    tokenizer = ModelTokenizer(smollm2_dir)
    e2, x82, xac = (_byte_token(tokenizer, b) for b in (0xE2, 0x82, 0xAC))
    special = tokenizer.backend.token_to_id("<|im_end|>")
    # E2 82 AC is "€"; a skipped special token between its bytes does not break it.
    assert _stream(tokenizer, [e2, x82, special, xac]) == ["", "", "", "€", ""]
    # E2 then "A": the E2 can never complete, so it goes out as U+FFFD with the "A".
    a = tokenizer.encode("A", add_special_tokens=False)
    assert _stream(tokenizer, [e2] + a) == ["", "\ufffdA", ""]
    # E2 then a second first byte: the E2 is broken, the C3 may still complete.
    c3, xa9 = _byte_token(tokenizer, 0xC3), _byte_token(tokenizer, 0xA9)
    deltas = _stream(tokenizer, [e2, c3, xa9])
    assert "".join(deltas) == "\ufffdé" and deltas[-2:] == ["\ufffdé", ""]
