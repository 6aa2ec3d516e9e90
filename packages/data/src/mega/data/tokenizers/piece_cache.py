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
the tokenizer's own pre-tokens by a ``split_words`` function, so that only never-seen *words* are
encoded, by the reference or by a faster engine the tests prove equal to it (``encode_words``).

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
# Maximal runs of two or more whitespace characters (a run with no space in it is harmless: it
# glues nothing that a lone-space cut would have separated).
_RUN = re.compile(f"[{_WS}][{_WS}]+")
# Spaces that are not lone are written as NUL inside piece keys, so that ``str.split(" ")`` cuts
# only at lone spaces; texts that contain NUL themselves take the slow path.
_HIDDEN_SPACE = "\0"
_ASCII_WS = "\t\n\r\x0b\x0c"
_NON_ASCII_WS = re.compile("[" + "".join(c for c in sorted(WHITESPACE) if not c.isascii()) + "]")


def _hide_run_spaces(match: re.Match) -> str:
    return match.group().replace(" ", _HIDDEN_SPACE)


def split_pieces(text: str) -> list[str] | None:
    """Cut ``text`` at lone spaces (spaces whose neighbours are not whitespace).

    The first piece is returned whole, every later one without the space that precedes it (the
    caches key them that way, which saves building strings); spaces inside a piece are spelt
    NUL (:func:`piece_text` undoes that). ``None`` for text that holds NUL itself.
    """
    if _HIDDEN_SPACE in text:
        return None
    if not text.isascii() and _NON_ASCII_WS.search(text):
        return _RUN.sub(_hide_run_spaces, text).split(" ")
    # Otherwise the only whitespace is ASCII, and a few C-speed replaces do the same: double
    # spaces, then spaces touching another whitespace character, then the odd space left at the
    # end of a run of spaces.
    if "  " in text:
        text = text.replace("  ", "\0\0")
    for ws in _ASCII_WS:
        if ws in text:
            text = text.replace(" " + ws, "\0" + ws).replace(ws + " ", ws + "\0")
    if _HIDDEN_SPACE in text:
        text = text.replace("\0 ", "\0\0").replace(" \0", "\0\0")
    return text.split(" ")


def piece_text(piece: str) -> str:
    return piece.replace(_HIDDEN_SPACE, " ") if _HIDDEN_SPACE in piece else piece


class _Generations:
    """A dictionary in two generations: when the young one fills up it becomes the old one and
    the previous old one is dropped. Memory stays under two generations; entries still in use
    are found in the old generation and moved back instead of being computed again."""

    def __init__(self, limit: int):
        self.limit = limit
        self.young: dict[str, bytes] = {}
        self.old: dict[str, bytes] = {}

    def __len__(self) -> int:
        return len(self.young) + len(self.old)

    def rotate_if_full(self) -> None:
        if len(self.young) >= self.limit:
            self.old, self.young = self.young, {}

    def missing(self, keys) -> list[str]:
        """Keys not in the young generation; those found in the old one are moved back."""
        young, old = self.young, self.old
        missing = []
        for key in set(keys).difference(young):
            value = old.get(key)
            if value is None:
                missing.append(key)
            else:
                young[key] = value
        return missing


class PieceCache:
    """Encode texts through a piece -> ids cache in front of ``encode_batch`` (the reference).

    ``encode_batch(list_of_str) -> list_of_id_lists`` must behave exactly like the reference
    tokenizer on whole texts. ``split_words(piece) -> list[str] | None``, if given, must return the
    tokenizer's pre-tokens of a piece, or ``None`` where it cannot be sure (then the whole piece
    goes to the reference); ``encode_words``, if given, encodes such pre-tokens (faster than the
    reference, and exactly like it). Cached ids are stored as bytes in ``dtype`` so that a text's
    ids are one ``bytes.join`` away. Each cache keeps at most two generations of about
    ``generation_size`` entries (some 150 bytes each), so memory is bounded however much text
    goes through.
    """

    def __init__(
        self,
        encode_batch: Callable[[list[str]], list[list[int]]],
        dtype,
        split_words: Callable[[str], list[str] | None] | None = None,
        encode_words: Callable[[list[str]], list[list[int]]] | None = None,
        generation_size: int = 25_000,
    ):
        self._encode_batch = encode_batch
        self._split_words = split_words
        self._encode_words = encode_words or encode_batch
        self.dtype = np.dtype(dtype)
        # Pieces after a space repeat most and are worth the most memory; words (looked up only
        # for missed pieces) and the first pieces of texts much less.
        self._first = _Generations(generation_size // 5)  # pieces at the start of a text
        self._spaced = _Generations(generation_size)  # pieces after a lone space, keyed without it
        self._words = _Generations(generation_size // 2)  # pre-tokens of missed pieces (with split_words)
        self.misses = 0  # pieces that were not in the cache
        self.reference_calls = 0  # strings the reference tokenizer encoded

    def __len__(self) -> int:
        return len(self._first) + len(self._spaced) + len(self._words)

    def encode(self, text: str) -> list[int]:
        tokens, _ = self.encode_packed([text])
        return tokens.tolist()

    def encode_packed(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """All texts' ids back to back (an array of ``dtype``) and the number of ids per text."""
        for cache in (self._first, self._spaced, self._words):
            cache.rotate_if_full()
        split = [split_pieces(text) for text in texts]
        encoded: list[bytes | None] = [None] * len(split)
        unsplit = [k for k, pieces in enumerate(split) if pieces is None]
        for k, ids in zip(unsplit, self._reference([texts[k] for k in unsplit]), strict=True):
            encoded[k] = ids
        missed = self._join(split, range(len(split)), encoded)
        if missed:
            self._fill(split, missed)
            self._join(split, missed, encoded)
        itemsize = self.dtype.itemsize
        lengths = np.fromiter((len(b) // itemsize for b in encoded), np.int64, len(encoded))
        return np.frombuffer(b"".join(encoded), self.dtype), lengths

    def _join(self, split: list, which, encoded: list) -> list[int]:
        first, spaced = self._first.young.__getitem__, self._spaced.young.__getitem__
        missed = []
        for k in which:
            pieces = split[k]
            if pieces is None:
                continue
            try:
                encoded[k] = first(pieces[0]) + b"".join(map(spaced, islice(pieces, 1, None)))
            except KeyError:
                missed.append(k)
        return missed

    def _fill(self, split: list, missed: list[int]) -> None:
        new_first = self._first.missing(split[k][0] for k in missed)
        new_spaced = self._spaced.missing(chain.from_iterable(islice(split[k], 1, None) for k in missed))
        texts = [piece_text(p) for p in new_first] + [" " + piece_text(p) for p in new_spaced]
        self.misses += len(texts)
        encoded = self._encode_pieces(texts)
        self._first.young.update(zip(new_first, encoded, strict=False))
        self._spaced.young.update(zip(new_spaced, islice(encoded, len(new_first), None), strict=False))

    def _encode_pieces(self, texts: list[str]) -> list[bytes]:
        if self._split_words is None:
            return self._reference(texts)
        words = [self._split_words(text) for text in texts]
        whole = [text for text, split in zip(texts, words, strict=True) if split is None]
        new_words = self._words.missing(chain.from_iterable(w for w in words if w is not None))
        self._words.young.update(zip(new_words, self._as_bytes(self._encode_words(new_words)), strict=True))
        whole_encoded = iter(self._reference(whole))
        lookup = self._words.young.__getitem__
        return [next(whole_encoded) if split is None else b"".join(map(lookup, split)) for split in words]

    def _reference(self, texts: list[str]) -> list[bytes]:
        if not texts:
            return []
        self.reference_calls += len(texts)
        return self._as_bytes(self._encode_batch(texts))

    def _as_bytes(self, encoded: list[list[int]]) -> list[bytes]:
        dtype = self.dtype
        return [np.asarray(ids, dtype).tobytes() for ids in encoded]
