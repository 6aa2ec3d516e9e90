"""The tokenizer contract shared by every package.

Tokenizer plugins (``register_tokenizers``) register a factory under a ``--tokenizer-type`` name;
the factory is called with :class:`TokenizerOptions` and returns an object with the interface of
:class:`Tokenizer`. The concrete tokenizers live in ``mega.data``; the core only states the shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class TokenizerOptions:
    """The tokenizer flags Megatron scripts carry (``--vocab-file`` etc.)."""

    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    vocab_extra_ids: int = 0  # T5's sentinel tokens appended to a WordPiece vocabulary


@dataclass(frozen=True)
class TokenizerSpec:
    """How to rebuild a tokenizer: its registered ``--tokenizer-type`` and the options it was made
    with. Checkpoints carry one (with the option files copied beside the weights) so generation
    and conversion use the tokenizer the model was trained with."""

    type: str
    options: TokenizerOptions

    def build(self, plugins) -> Tokenizer:
        """The tokenizer, made by the factory the installed plugins register for ``type``."""
        return plugins.tokenizers.get(self.type)(self.options)


@runtime_checkable
class Tokenizer(Protocol):
    """What training, preprocessing and generation need from a tokenizer.

    ``eod`` is the id appended by ``--append-eod``; ``pad`` and ``bos`` may be ``None`` where a
    vocabulary has no such token. BERT-style tokenizers also have ``cls``, ``sep`` and ``mask``.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    @property
    def pad(self) -> int | None: ...

    @property
    def bos(self) -> int | None: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...
