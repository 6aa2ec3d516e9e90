"""``NullTokenizer``: text is already ids written as space-separated integers (benchmarks, tests).

As in Megatron, ``--vocab-size N`` means ids ``0 .. N-1`` plus an end-of-document id ``N``, so
``vocab_size`` is ``N + 1``.
"""

from __future__ import annotations

from collections.abc import Sequence

from mega.data.tokenizers.base import BaseTokenizer, TokenizerError


class NullTokenizer(BaseTokenizer):
    def __init__(self, vocab_size: int | None):
        if vocab_size is None or int(vocab_size) <= 0:
            raise TokenizerError("NullTokenizer needs --vocab-size (a positive number of ids)")
        self._vocab_size_without_eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def eod(self) -> int:
        return self._vocab_size_without_eod

    def tokenize(self, text: str) -> list[int]:
        try:
            return [int(word) for word in text.split(" ")] if text else []
        except ValueError:
            raise ValueError(f"NullTokenizer expects space-separated integers, got {text[:40]!r}") from None

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in ids)
