"""``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``--vocab-file`` (vocab.json / encoder.json)
and ``--merge-file`` (merges.txt / vocab.bpe).

The reference is the `tokenizers` library configured as transformers' GPT2TokenizerFast is
(byte-level pre-tokenizer without a prefix space, ``<|endoftext|>`` a special token), which is
what Megatron's GPT2BPETokenizer wraps. Batches go through :class:`PieceCache`, which returns the
reference's ids several times faster on real text; for ASCII text it also caches GPT-2's
pre-tokens, and encodes new ones with tiktoken's BPE core (with the same ranks, checked to agree
with the reference), so the reference sees only non-ASCII pieces it has not seen before.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import numpy as np

from mega.data.tokenizers.base import LibraryTokenizer, TokenizerError, require_file
from mega.data.tokenizers.piece_cache import PieceCache

END_OF_TEXT = "<|endoftext|>"

# GPT-2's pre-tokenization regex restricted to ASCII, where \p{L} is [A-Za-z], \p{N} is [0-9] and
# \s is [\t\n\v\f\r ] (Python's own \s would add U+001C..U+001F, which Unicode calls punctuation).
_WS = "\t\n\x0b\x0c\r "
_ASCII_PRE_TOKENS = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (its vocab.json is written in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def tiktoken_word_encoder(vocab: dict[str, int], merge_file: str):
    """A fast encoder for single GPT-2 pre-tokens: tiktoken's BPE core with the files' ranks.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank, `tokenizers` the
    pair listed first in the merges file; the two agree when every token's id is its merge's
    position (after the 256 bytes), which is how GPT-2's files are made (tiktoken's own
    ``data_gym_to_mergeable_bpe_ranks`` checks the same). For files that are not so ordered, or
    without tiktoken, this returns ``None`` and the reference encodes the words.
    """
    try:
        # start-up cost: a tokenizer's library loads only when that tokenizer is built
        import tiktoken
    except ImportError:
        return None
    with open(merge_file, encoding="utf-8") as stream:
        merges = [line.split() for line in stream.read().splitlines()[1:] if line and not line.startswith("#version")]
    byte_tokens = bytes_to_unicode()
    if any(vocab.get(char, 256) >= 256 for char in byte_tokens.values()):
        return None  # the 256 single bytes must be the first ids (in any order)
    for position, pair in enumerate(merges):
        if len(pair) != 2 or vocab.get(pair[0] + pair[1]) != 256 + position:
            return None
    # Map each printable stand-in back to its byte (as a latin-1 character), then encode.
    to_latin1 = str.maketrans({char: chr(byte) for byte, char in byte_tokens.items()})
    ranks = {
        token.translate(to_latin1).encode("latin-1"): token_id for token, token_id in vocab.items() if token != END_OF_TEXT
    }
    if len(ranks) != 256 + len(merges):
        return None
    encoding = tiktoken.Encoding(
        name="mega-gpt2-words",
        pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        mergeable_ranks=ranks,
        special_tokens={},
    )

    def encode_words(words: list[str]) -> list[list[int]]:
        return [encoding.encode_ordinary(word) for word in words]

    return encode_words


def ascii_pre_tokens(text: str) -> list[str] | None:
    """GPT-2's pre-tokens of an ASCII text; ``None`` (the reference decides) for other text and
    for text holding ``<|endoftext|>``, which the reference matches as one special token."""
    if not text.isascii() or END_OF_TEXT in text:
        return None
    return _ASCII_PRE_TOKENS.findall(text)


class GPT2BPETokenizer(LibraryTokenizer):
    def __init__(self, vocab_file: str | None, merge_file: str | None):
        # start-up cost, as above
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        name = "GPT2BPETokenizer"
        vocab_file = require_file(vocab_file, "--vocab-file", name, "GPT-2 vocab.json / encoder.json")
        merge_file = require_file(merge_file, "--merge-file", name, "GPT-2 merges.txt / vocab.bpe")
        try:
            with open(vocab_file, encoding="utf-8") as stream:
                vocab = json.load(stream)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise TokenizerError(f"--vocab-file {vocab_file}: not a JSON vocabulary ({error})") from None
        if not isinstance(vocab, dict) or not vocab:
            raise TokenizerError(f"--vocab-file {vocab_file}: expected a JSON object of token -> id")
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as error:
            raise TokenizerError(f"--merge-file {merge_file}: cannot be read as BPE merges ({error})") from None
        tokenizer = Tokenizer(model)
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        if END_OF_TEXT in vocab:
            tokenizer.add_special_tokens([AddedToken(END_OF_TEXT, special=True)])
            self._eod = vocab[END_OF_TEXT]
        else:
            raise TokenizerError(f"--vocab-file {vocab_file}: has no {END_OF_TEXT} token (the GPT-2 end of document)")
        self.reference = tokenizer
        self._vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._caches: dict[np.dtype, PieceCache] = {}
        self._encode_words = tiktoken_word_encoder(vocab, merge_file)

    def tokenize_packed(self, texts: Sequence[str], dtype) -> tuple[np.ndarray, np.ndarray]:
        dtype = np.dtype(dtype)
        cache = self._caches.get(dtype)
        if cache is None:
            cache = self._caches[dtype] = PieceCache(self.tokenize_batch, dtype, ascii_pre_tokens, self._encode_words)
        return cache.encode_packed(texts)
