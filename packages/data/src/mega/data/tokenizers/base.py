"""What every mega-data tokenizer shares: the interface of ``mega.core.tokenizer.Tokenizer`` plus
the batch encoders ``mega preprocess`` uses, and the checks that turn a bad flag into a clear error."""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence
from itertools import chain

import numpy as np


class TokenizerError(ValueError):
    """A tokenizer cannot be built from the given flags or files; the message names the flag."""


def require_file(path: str | None, flag: str, tokenizer: str, what: str) -> str:
    if not path:
        raise TokenizerError(f"{tokenizer} needs {flag} ({what})")
    if not os.path.isfile(path):
        kind = "a directory, not a file" if os.path.isdir(path) else "no such file"
        raise TokenizerError(f"{flag} {path}: {kind}")
    return path


class BaseTokenizer(abc.ABC):
    """The interface every tokenizer implements, with defaults for its optional parts
    (subclasses set the special ids they have)."""

    pad: int | None = None
    bos: int | None = None
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        ...

    @property
    @abc.abstractmethod
    def eod(self) -> int:
        ...

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        ...

    @abc.abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        ...

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(text) for text in texts]

    def tokenize_packed(self, texts: Sequence[str], dtype) -> tuple[np.ndarray, np.ndarray]:
        """All texts' ids back to back in ``dtype``, and the number of ids of each text."""
        encoded = self.tokenize_batch(texts)
        lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
        tokens = np.fromiter(chain.from_iterable(encoded), dtype, int(lengths.sum()))
        return tokens, lengths

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class LibraryTokenizer(BaseTokenizer):
    """A tokenizer whose ids come from a ``tokenizers.Tokenizer`` held in ``self.reference``.

    Subclasses load ``reference`` and set ``_vocab_size`` and ``_eod``; special tokens written in
    text encode as their ids, and detokenizing keeps them.
    """

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
