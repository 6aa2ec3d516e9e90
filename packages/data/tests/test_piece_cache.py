"""The cached fast path (PieceCache) against the reference tokenizers, character by character.

Where text is cut into pieces depends only on which characters are whitespace, so every code
point that could matter (all separators, control and format characters, everything below
U+0800, and every 149th of the rest, unassigned ones included) is tried in every whitespace-sensitive position.
"""

from __future__ import annotations

import unicodedata

import numpy as np
import pytest

from mega.core.tokenizer import TokenizerOptions
from mega.data.tokenizers import make_gpt2_bpe, make_tiktoken
from mega.data.tokenizers.gpt2_bpe import ascii_pre_tokens
from mega.data.tokenizers.piece_cache import WHITESPACE, PieceCache, piece_text, split_pieces

TEMPLATES = ["a {c} b", "a{c} b", "a {c}b", "{c} a", "a {c}", "a  {c}", "{c}{c} a", " {c}\n b", "a\n{c} b", "{c}  {c}"]


def probe_code_points() -> list[str]:
    points = set(range(0x800)) | set(range(0x800, 0x110000, 149))
    points |= {p for p in range(0x110000) if unicodedata.category(chr(p)) in ("Zs", "Zl", "Zp", "Cc", "Cf")}
    points -= set(range(0xD800, 0xE000))  # lone surrogates cannot be encoded as UTF-8 at all
    return [chr(p) for p in sorted(points)]


@pytest.fixture(scope="module")
def probes() -> list[str]:
    # One text per 8 code points keeps the reference's per-call cost low and a failure local.
    points = probe_code_points()
    return ["|".join(t.format(c=c) for c in points[i : i + 8] for t in TEMPLATES) for i in range(0, len(points), 8)]


def fresh_cache(tokenizer, split_words=None) -> PieceCache:
    return PieceCache(tokenizer.tokenize_batch, np.int32, split_words)


def assert_cache_matches(cache: PieceCache, reference, texts):
    tokens, lengths = cache.encode_packed(texts)
    expected = reference(texts)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    for i, ids in enumerate(expected):
        assert tokens[offsets[i] : offsets[i + 1]].tolist() == ids, repr(texts[i])


def test_gpt2_every_code_point(gpt2_files, probes):
    vocab, merges = gpt2_files
    tokenizer = make_gpt2_bpe(TokenizerOptions(vocab_file=vocab, merge_file=merges))
    assert_cache_matches(fresh_cache(tokenizer, ascii_pre_tokens), tokenizer.tokenize_batch, probes)


@pytest.mark.parametrize("pattern", ["cl100k", "v2"])
def test_tiktoken_patterns_every_code_point(cl100k_file, probes, pattern):
    tokenizer = make_tiktoken(TokenizerOptions(tokenizer_model=cl100k_file), pattern=pattern, num_special_tokens=0)
    assert_cache_matches(fresh_cache(tokenizer), tokenizer.tokenize_batch, probes)


def test_gpt2_ascii_pre_tokens_in_every_context(gpt2_files):
    """The ASCII word splitter against the reference on all pairs of ASCII characters and on
    triples of characters that play different roles in GPT-2's regex."""
    vocab, merges = gpt2_files
    tokenizer = make_gpt2_bpe(TokenizerOptions(vocab_file=vocab, merge_file=merges))
    pairs = [f"{chr(a)}{chr(b)}" for a in range(128) for b in range(128)]
    roles = "aZ09'stlvremd \n\t\r\x0b\x1c!_-"
    triples = [f"x{a}{b}{c}y" for a in roles for b in roles for c in roles]
    texts = [" ".join(pairs[i : i + 64]) for i in range(0, len(pairs), 64)] + [
        "".join(triples[i : i + 32]) for i in range(0, len(triples), 32)
    ]
    cache = fresh_cache(tokenizer, ascii_pre_tokens)
    assert_cache_matches(cache, tokenizer.tokenize_batch, texts)
    assert cache.reference_calls < cache.misses  # the word level did take over


def test_split_pieces_reassembles_the_text():
    texts = ["", " ", "a", "a b", " a b ", "a  b", "a   b", "a \n b", "x\n\ny z", "a\u3000 b c", "\t\t", "a\u00a0b c", "é  ü \u2003x"]
    for text in texts:
        pieces = split_pieces(text)
        assert piece_text(pieces[0]) + "".join(" " + piece_text(p) for p in pieces[1:]) == text
        for piece in map(piece_text, pieces[1:]):
            # every cut was at a lone space: the characters around it are not whitespace
            assert not piece or piece[0] not in WHITESPACE
    assert split_pieces("a b\n\nc d  e") == ["a", "b\n\nc", "d\x00\x00e"]


def test_cache_is_bounded(gpt2_files, mixed_corpus):
    vocab, merges = gpt2_files
    tokenizer = make_gpt2_bpe(TokenizerOptions(vocab_file=vocab, merge_file=merges))
    cache = PieceCache(tokenizer.tokenize_batch, np.uint16, ascii_pre_tokens, generation_size=50)
    expected = tokenizer.tokenize_batch(mixed_corpus)
    for start in range(0, len(mixed_corpus), 20):
        tokens, _ = cache.encode_packed(mixed_corpus[start : start + 20])
        assert tokens.tolist() == [t for e in expected[start : start + 20] for t in e]
        # at most two generations each, plus what one batch of 20 texts adds before rotating
        assert len(cache) <= 2 * (50 + 10 + 25) + 20 * 400


def test_text_with_nul_goes_to_the_reference(gpt2_files):
    vocab, merges = gpt2_files
    tokenizer = make_gpt2_bpe(TokenizerOptions(vocab_file=vocab, merge_file=merges))
    texts = ["a\x00b c  d", "a b  c", "x\x00"]  # NUL is how the cache spells spaces inside runs
    cache = fresh_cache(tokenizer, ascii_pre_tokens)
    assert_cache_matches(cache, tokenizer.tokenize_batch, texts)
    assert split_pieces("a\x00b") is None


def test_tiktoken_word_engine_equals_reference(gpt2_files, mixed_corpus):
    """tiktoken's BPE core with GPT-2's ranks encodes new ASCII words; prove it agrees with the
    reference on every vocabulary entry, every word of Python's documentation and of the mixed
    corpus, and random words of letters, digits and punctuation."""
    import json
    import random
    from pydoc_data.topics import topics

    from mega.data.tokenizers.gpt2_bpe import bytes_to_unicode, tiktoken_word_encoder

    vocab_file, merges = gpt2_files
    tokenizer = make_gpt2_bpe(TokenizerOptions(vocab_file=vocab_file, merge_file=merges))
    vocab = json.load(open(vocab_file, encoding="utf-8"))
    encode_words = tiktoken_word_encoder(vocab, merges)
    assert encode_words is not None
    decode = {char: byte for byte, char in bytes_to_unicode().items()}
    words = set()
    for token in vocab:
        raw = bytes(decode[c] for c in token) if token != "<|endoftext|>" else b""
        if raw.isascii() and raw:
            text = raw.decode()
            words.update(w for w in (ascii_pre_tokens(text) or []) if w)
    for text in [*topics.values(), *mixed_corpus]:
        words.update(ascii_pre_tokens(text) or [])
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&()*+,-./:;<=>?@[]^_`{|}~"
    for _ in range(20000):
        random_text = (" " if rng.random() < 0.5 else "") + "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        words.update(ascii_pre_tokens(random_text))
    words = sorted(words)
    assert len(words) > 60000
    assert encode_words(words) == tokenizer.tokenize_batch(words)


def test_tiktoken_word_engine_refuses_files_not_in_merge_order(tmp_path):
    from mega.data.tokenizers.gpt2_bpe import bytes_to_unicode, tiktoken_word_encoder

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    vocab.update({"ab": 257, "abc": 256})  # ids not in merge order
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\nab c\n")
    assert tiktoken_word_encoder(vocab, str(tmp_path / "merges.txt")) is None
    vocab.update({"ab": 256, "abc": 257})
    assert tiktoken_word_encoder(vocab, str(tmp_path / "merges.txt")) is not None
