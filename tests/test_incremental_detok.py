"""Incremental detokenization and stop strings: the text decoded a token at a time, and the token at which a
stop string is found, equal what decoding the whole output after every token gives, on a byte-level BPE
(multi-byte characters split over several tokens) and on tokenizers whose text spans characters or
depends on the neighbouring token."""

import random

import pytest

from areal_jax.inference.stop_strings import StopStringMatcher
from areal_jax.models.tokenizer import REPLACEMENT_CHAR, HFTokenizer, IncrementalDecoder
from tests.tiny_hf_run import make_bpe_tokenizer_dir

TEXTS = ("héllo wörld 数学 ✓ 😀 ok", "def f(x):\n    return x + 1  # ∑ë😀😀", "12+34=46\n\nThe answer is 46.")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> HFTokenizer:
    return HFTokenizer.from_dir(make_bpe_tokenizer_dir(tmp_path_factory.mktemp("bpe")))


def _first_stop_by_full_decode(decode, ids, stops) -> int | None:
    """The reference: the first token after which the whole output's text contains a stop string."""
    for i in range(len(ids)):
        if any(stop in decode(ids[: i + 1]) for stop in stops):
            return i
    return None


def _first_stop_incremental(decode, ids, stops) -> int | None:
    matcher = StopStringMatcher(tuple(stops), decode)
    return next((i for i, token in enumerate(ids) if matcher.push(token)), None)


def test_pieces_join_to_the_full_decode_on_byte_level_bpe(bpe):
    rng = random.Random(0)
    sequences = [bpe.encode(text) for text in TEXTS]
    sequences += [[rng.randrange(bpe.vocab_size) for _ in range(40)] for _ in range(20)]  # invalid UTF-8 too
    split_characters = 0
    for ids in sequences:
        decoder, text = IncrementalDecoder(bpe.decode), ""
        for i, token in enumerate(ids):
            piece = decoder.push(token)
            split_characters += not piece
            text += piece
            # a trailing incomplete character is held back until its last byte arrives
            assert text == bpe.decode(ids[: i + 1]).rstrip(REPLACEMENT_CHAR)
    assert split_characters > 10  # the texts do split characters over tokens


def test_stop_strings_found_at_the_same_token_as_full_decode(bpe):
    ids = bpe.encode(TEXTS[0])
    pieces = [bpe.decode([t]) for t in ids]
    # "数学" spans six one-byte tokens, "✓ 😀" crosses a space token; "lo w" spans the tokens of "l", "o", " ", "w"
    for stops in (["数学"], ["✓ 😀"], ["lo w"], ["zzz", "ö"], ["😀 ok", "wör"]):
        expected = _first_stop_by_full_decode(bpe.decode, ids, stops)
        assert expected is not None and _first_stop_incremental(bpe.decode, ids, stops) == expected
    assert REPLACEMENT_CHAR in pieces  # the case above is multi-byte: characters split over byte tokens
    assert _first_stop_incremental(bpe.decode, ids, ["absent"]) is None


def test_stop_strings_on_random_outputs_match_full_decode(bpe):
    """Random stop strings cut from the output's text (never containing U+FFFD, which stands for bytes
    that are not a character and so can't be what a user stops on)."""
    rng = random.Random(1)
    for trial in range(60):
        ids = [rng.randrange(bpe.vocab_size) for _ in range(30)] if trial % 2 else bpe.encode(rng.choice(TEXTS))
        text = bpe.decode(ids)
        stops = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randint(1, 6)].split(REPLACEMENT_CHAR)[0] or "q")
        assert _first_stop_by_full_decode(bpe.decode, ids, stops) == _first_stop_incremental(bpe.decode, ids, stops)


def test_stop_string_split_across_two_multi_character_tokens():
    """Each token is two characters; the stop string is the last of one token and the first of the next,
    so no single token's text contains it and an `endswith` check on one token would miss longer ones."""

    def decode(ids):
        return "".join(chr(97 + t % 26) + chr(65 + t % 7) for t in ids)

    ids = [3, 9, 14, 2, 20, 5, 11]
    text = decode(ids)
    for k in range(len(ids) - 1):
        stop = text[2 * k + 1 : 2 * k + 3]  # crosses the boundary between tokens k and k + 1
        assert _first_stop_incremental(decode, ids, [stop]) == _first_stop_by_full_decode(decode, ids, [stop]) <= k + 1
    long_stop = text[3:10]  # spans four tokens
    assert _first_stop_incremental(decode, ids, [long_stop, "q"]) == 4


def test_context_dependent_token_text_decodes_as_in_the_whole_sequence():
    """A SentencePiece-style decoder drops the leading space of the text it decodes: a piece decoded alone
    would lose the space between words, so the decoder keeps the previous piece's tokens as context."""
    vocab = ["▁the", "▁cat", "s", "▁sat", "▁on", "!"]

    def decode(ids):
        return "".join(vocab[t] for t in ids).replace("▁", " ").removeprefix(" ")

    ids = [0, 1, 2, 3, 4, 0, 1, 5]
    decoder = IncrementalDecoder(decode)
    assert "".join(decoder.push(t) for t in ids) == decode(ids) == "the cats sat on the cat!"
    assert _first_stop_incremental(decode, ids, ["s sat"]) == 3 == _first_stop_by_full_decode(decode, ids, ["s sat"])
