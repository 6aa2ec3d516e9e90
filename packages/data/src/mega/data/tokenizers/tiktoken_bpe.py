"""``TikTokenizer``: tiktoken BPE from ``--tokenizer-model``, as Megatron's TikTokenizer builds it.

The model file is either a ``.tiktoken`` file (``base64-token rank`` per line, as tiktoken and
OpenAI ship them) or Megatron's JSON list of ``{"rank", "token_bytes", "token_str"}``. Megatron's
rules: the first ``num_special_tokens`` ids (default 1000) are special tokens ``<unk> <s> </s>
<mask> <pad> <cls> <sep>`` then ``<SPECIAL_7>`` ...; every BPE rank is shifted up by that number;
the vocabulary is cut to ``vocab_size - num_special_tokens`` ranks when ``--vocab-size`` is given;
text is split with the ``v2`` pattern by default (``v1`` or a regex can be chosen); special tokens
written in the text are encoded as their ids. ``eod`` is ``</s>``.

With ``num_special_tokens=0`` and an encoding's own pattern this is plain tiktoken, e.g. cl100k.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence

import numpy as np

from mega.data.tokenizers.base import BaseTokenizer, TokenizerError, require_file
from mega.data.tokenizers.piece_cache import PieceCache

PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    # The pattern of tiktoken's cl100k_base, for plain cl100k files.
    "cl100k": (
        r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
        r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
    ),
}
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]


def load_ranks(path: str) -> dict[bytes, int]:
    """BPE ranks from a .tiktoken file or Megatron's JSON vocabulary."""
    with open(path, "rb") as stream:
        data = stream.read()
    if data.lstrip()[:1] == b"[":
        try:
            entries = json.loads(data)
            ranks = {base64.b64decode(e["token_bytes"]): int(e["rank"]) for e in entries}
        except (ValueError, KeyError, TypeError) as error:
            raise TokenizerError(f"--tokenizer-model {path}: not a Megatron tiktoken JSON vocabulary ({error})") from None
    else:
        ranks = {}
        for number, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as error:
                raise TokenizerError(f"--tokenizer-model {path}:{number}: not a .tiktoken line ({error})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"--tokenizer-model {path}: ranks must be 0 .. {len(ranks) - 1} without gaps")
    return ranks


class TikTokenizer(BaseTokenizer):
    def __init__(
        self,
        tokenizer_model: str | None,
        vocab_size: int | None = None,
        pattern: str = "v2",
        num_special_tokens: int = 1000,
        special_tokens: Sequence[str] | None = None,
    ):
        # start-up cost: a tokenizer's library loads only when that tokenizer is built
        import tiktoken

        path = require_file(tokenizer_model, "--tokenizer-model", "TikTokenizer", "a .tiktoken or Megatron JSON vocabulary")
        special_tokens = list(SPECIAL_TOKENS if special_tokens is None else special_tokens)
        if num_special_tokens and not set(SPECIAL_TOKENS) <= set(special_tokens):
            raise TokenizerError(f"TikTokenizer special tokens must include {', '.join(SPECIAL_TOKENS)}")
        if len(special_tokens) > num_special_tokens and num_special_tokens:
            raise TokenizerError(f"{len(special_tokens)} special tokens do not fit in --tiktoken-num-special-tokens {num_special_tokens}")
        if not num_special_tokens:
            special_tokens = []
        special_tokens += [f"<SPECIAL_{i}>" for i in range(len(special_tokens), num_special_tokens)]

        ranks = load_ranks(path)
        if vocab_size is not None:
            inner = vocab_size - num_special_tokens
            if inner > len(ranks) or inner <= 0:
                raise TokenizerError(
                    f"--vocab-size {vocab_size} needs {inner} BPE ranks after {num_special_tokens} "
                    f"special tokens; {path} has {len(ranks)}"
                )
            ranks = {token: rank for token, rank in ranks.items() if rank < inner}
        self._vocab_size = len(ranks) + num_special_tokens
        self.num_special_tokens = num_special_tokens
        self.special_tokens = {token: i for i, token in enumerate(special_tokens)}
        self.encoding = tiktoken.Encoding(
            name=f"mega-{path}",
            pat_str=PATTERNS.get(pattern, pattern),
            mergeable_ranks={token: rank + num_special_tokens for token, rank in ranks.items()},
            special_tokens=self.special_tokens,
        )
        ids = self.special_tokens.get
        self.bos, self.pad, self.mask, self.cls, self.sep = (ids(t) for t in ("<s>", "<pad>", "<mask>", "<cls>", "<sep>"))
        self._eod = ids("</s>")
        self._caches: dict[np.dtype, PieceCache] = {}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        if self._eod is None:
            raise TokenizerError("this TikTokenizer has no special tokens, so no end-of-document token")
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.encoding.encode_batch(list(texts), allowed_special="all", num_threads=1)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids))

    def tokenize_packed(self, texts: Sequence[str], dtype) -> tuple[np.ndarray, np.ndarray]:
        dtype = np.dtype(dtype)
        cache = self._caches.get(dtype)
        if cache is None:
            cache = self._caches[dtype] = PieceCache(self.tokenize_batch, dtype)
        return cache.encode_packed(texts)
