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
from mega.data.tokenizers.piece_cache import WHITESPACE, PieceCache, split_pieces

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
    for text in ["", " ", "a", "a b", " a b ", "a  b", "a \n b", "x\n\ny z", "a\u3000 b c", "\t\t", "a\u00a0b c"]:
        pieces = split_pieces(text)
        assert pieces[0] + "".join(" " + p for p in pieces[1:]) == text
        for piece in pieces[1:]:
            # every cut was at a lone space: the characters around it are not whitespace
            assert not piece or piece[0] not in WHITESPACE
    assert split_pieces("a b\n\nc d  e") == ["a", "b\n\nc", "d  e"]


def test_cache_is_bounded(gpt2_files, mixed_corpus):
    vocab, merges = gpt2_files
    tokenizer = make_gpt2_bpe(TokenizerOptions(vocab_file=vocab, merge_file=merges))
    cache = PieceCache(tokenizer.tokenize_batch, np.uint16, ascii_pre_tokens, max_entries=50)
    expected = tokenizer.tokenize_batch(mixed_corpus)
    for start in range(0, len(mixed_corpus), 20):
        tokens, _ = cache.encode_packed(mixed_corpus[start : start + 20])
        assert tokens.tolist() == [t for e in expected[start : start + 20] for t in e]
        assert len(cache) < 50 + 20 * 400  # cleared whenever it outgrew the bound
