"""``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``--vocab-file`` (vocab.json / encoder.json)
and ``--merge-file`` (merges.txt / vocab.bpe).

The reference is the `tokenizers` library configured as transformers' GPT2TokenizerFast is
(byte-level pre-tokenizer without a prefix space, ``<|endoftext|>`` a special token), which is
what Megatron's GPT2BPETokenizer wraps. Batches go through :class:`PieceCache`, which returns the
reference's ids several times faster on real text; for ASCII text it also caches GPT-2's
pre-tokens, so the reference only ever sees words it has not seen before.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import numpy as np

from mega.data.tokenizers.base import BaseTokenizer, TokenizerError, require_file
from mega.data.tokenizers.piece_cache import PieceCache

END_OF_TEXT = "<|endoftext|>"

# GPT-2's pre-tokenization regex restricted to ASCII, where \p{L} is [A-Za-z], \p{N} is [0-9] and
# \s is [\t\n\v\f\r ] (Python's own \s would add U+001C..U+001F, which Unicode calls punctuation).
_WS = "\t\n\x0b\x0c\r "
_ASCII_PRE_TOKENS = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+"
)


def ascii_pre_tokens(text: str) -> list[str] | None:
    """GPT-2's pre-tokens of an ASCII text; ``None`` (the reference decides) for other text and
    for text holding ``<|endoftext|>``, which the reference matches as one special token."""
    if not text.isascii() or END_OF_TEXT in text:
        return None
    return _ASCII_PRE_TOKENS.findall(text)


class GPT2BPETokenizer(BaseTokenizer):
    def __init__(self, vocab_file: str | None, merge_file: str | None):
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

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self.reference.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.reference.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.reference.decode(list(ids), skip_special_tokens=False)

    def tokenize_packed(self, texts: Sequence[str], dtype) -> tuple[np.ndarray, np.ndarray]:
        dtype = np.dtype(dtype)
        cache = self._caches.get(dtype)
        if cache is None:
            cache = self._caches[dtype] = PieceCache(self.tokenize_batch, dtype, ascii_pre_tokens)
        return cache.encode_packed(texts)
