"""Memoised encoding for tokenizers whose pre-tokenizer never joins text across a lone space.

GPT-2's byte-level BPE, tiktoken's encodings and Megatron's TikTokenizer patterns all split text
with a regular expression in which a single space between two non-whitespace characters always
starts a new pre-token (``" ?\\p{L}+"`` and friends), and no pre-token reaches across it: only
whitespace runs contain a space anywhere but at their start. Text therefore encodes as the
concatenation of its *pieces*: cut before every such lone space (the space goes with the text
after it) and encode each piece on its own. Real text repeats pieces (" the", " of", " model."),
so a dictionary from piece to ids answers most of them without running the tokenizer at all.

Every id still comes from the reference tokenizer: a piece missing from the cache is encoded by
it, in one batch per call. What this module decides is only where the cuts go, and that depends
solely on which characters are whitespace. Optionally (GPT-2), a missed piece is first split into
the tokenizer's own pre-tokens by a ``split_words`` function, so that only never-seen *words*
reach the reference.

``tests/test_piece_cache.py`` checks the result against the reference tokenizer for every code
point in whitespace-sensitive positions and on a mixed-unicode corpus.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from itertools import chain, islice

import numpy as np

# Unicode's White_Space property, which is what ``\s`` means to the Rust regex engines of
# `tokenizers` and tiktoken. (Python's own ``\s`` also matches U+001C..U+001F, hence the list.)
WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000" + "".join(map(chr, range(0x2000, 0x200B)))
)
_WS = "".join(sorted(WHITESPACE))
# A stretch of whitespace in which a space touches another whitespace character: the spaces in
# it are not lone, so it, and the text on both sides up to the next lone spaces, is one piece.
_RUN_WITH_SPACE = re.compile(f"([{_WS}]*(?: [{_WS}]|[{_WS}] )[{_WS}]*)")
# For ASCII text the same test is a few substring searches, much faster than the regex.
_ASCII_SPACE_PAIRS = ("  ", " \n", "\n ", " \t", "\t ", " \r", "\r ", " \x0b", "\x0b ", " \x0c", "\x0c ")


def split_pieces(text: str) -> list[str]:
    """Cut ``text`` at lone spaces; the first piece is returned whole, every later one without
    the space that precedes it (the caches key them that way, which saves building strings)."""
    if text.isascii() and not any(pair in text for pair in _ASCII_SPACE_PAIRS):
        return text.split(" ")
    parts = _RUN_WITH_SPACE.split(text)
    pieces = parts[0].split(" ")
    for i in range(1, len(parts), 2):
        after = parts[i + 1].split(" ")
        pieces[-1] += parts[i] + after[0]
        pieces.extend(islice(after, 1, None))
    return pieces


class PieceCache:
    """Encode texts through a piece -> ids cache in front of ``encode_batch`` (the reference).

    ``encode_batch(list_of_str) -> list_of_id_lists`` must behave exactly like the reference
    tokenizer on whole texts. ``split_words(piece) -> list[str] | None``, if given, must return the
    tokenizer's pre-tokens of a piece, or ``None`` where it cannot be sure (then the whole piece
    goes to the reference). Cached ids are stored as bytes in ``dtype`` so that a text's ids are
    one ``bytes.join`` away; the caches are emptied when they hold ``max_entries``, which bounds
    their memory (about 150 bytes per entry).
    """

    def __init__(
        self,
        encode_batch: Callable[[list[str]], list[list[int]]],
        dtype,
        split_words: Callable[[str], list[str] | None] | None = None,
        max_entries: int = 200_000,
    ):
        self._encode_batch = encode_batch
        self._split_words = split_words
        self.dtype = np.dtype(dtype)
        self.max_entries = max_entries
        self._first: dict[str, bytes] = {}  # pieces at the start of a text
        self._spaced: dict[str, bytes] = {}  # pieces after a lone space, keyed without it
        self._words: dict[str, bytes] = {}  # pre-tokens of missed pieces (with split_words)
        self.misses = 0  # pieces that were not in the cache
        self.reference_calls = 0  # strings the reference tokenizer encoded

    def __len__(self) -> int:
        return len(self._first) + len(self._spaced) + len(self._words)

    def encode(self, text: str) -> list[int]:
        tokens, _ = self.encode_packed([text])
        return tokens.tolist()

    def encode_packed(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """All texts' ids back to back (an array of ``dtype``) and the number of ids per text."""
        if len(self) >= self.max_entries:
            self._first.clear()
            self._spaced.clear()
            self._words.clear()
        split = [split_pieces(text) for text in texts]
        encoded: list[bytes | None] = [None] * len(split)
        missed = self._join(split, range(len(split)), encoded)
        if missed:
            self._fill(split, missed)
            self._join(split, missed, encoded)
        itemsize = self.dtype.itemsize
        lengths = np.fromiter((len(b) // itemsize for b in encoded), np.int64, len(encoded))
        return np.frombuffer(b"".join(encoded), self.dtype), lengths

    def _join(self, split: list[list[str]], which, encoded: list) -> list[int]:
        first, spaced = self._first.__getitem__, self._spaced.__getitem__
        missed = []
        for k in which:
            pieces = split[k]
            try:
                encoded[k] = first(pieces[0]) + b"".join(map(spaced, islice(pieces, 1, None)))
            except KeyError:
                missed.append(k)
        return missed

    def _fill(self, split: list[list[str]], missed: list[int]) -> None:
        new_first = list({split[k][0] for k in missed}.difference(self._first))
        new_spaced: set[str] = set()
        for k in missed:
            new_spaced.update(islice(split[k], 1, None))
        new_spaced.difference_update(self._spaced)
        new_spaced_list = list(new_spaced)
        texts = new_first + [" " + piece for piece in new_spaced_list]
        self.misses += len(texts)
        encoded = self._encode_pieces(texts)
        for piece, ids in zip(new_first, encoded, strict=False):
            self._first[piece] = ids
        for piece, ids in zip(new_spaced_list, islice(encoded, len(new_first), None), strict=False):
            self._spaced[piece] = ids

    def _encode_pieces(self, texts: list[str]) -> list[bytes]:
        if self._split_words is None:
            return self._reference(texts)
        words = [self._split_words(text) for text in texts]
        whole = [text for text, split in zip(texts, words, strict=True) if split is None]
        new_words = list(set(chain.from_iterable(w for w in words if w is not None)).difference(self._words))
        encoded = self._reference(new_words + whole)
        self._words.update(zip(new_words, encoded, strict=False))
        whole_encoded = iter(encoded[len(new_words) :])
        lookup = self._words.__getitem__
        return [next(whole_encoded) if split is None else b"".join(map(lookup, split)) for split in words]

    def _reference(self, texts: list[str]) -> list[bytes]:
        if not texts:
            return []
        self.reference_calls += len(texts)
        dtype = self.dtype
        return [np.asarray(ids, dtype).tobytes() for ids in self._encode_batch(texts)]
