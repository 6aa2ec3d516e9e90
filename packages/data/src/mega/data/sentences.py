"""Sentence splitting for ``mega preprocess --split-sentences``, offline and without models.

Megatron uses NLTK's punkt, which must be downloaded first. This splitter uses rules instead: a
sentence ends at ``.``, ``!``, ``?`` or ``…`` (plus closing quotes or brackets) followed by
whitespace and anything but a lower-case letter; or at the full-width ``。！？``.
A period does not end a sentence after a common abbreviation (``Dr.``, ``e.g.``, ``Inc.``), a
single letter (an initial, ``J. Smith``) or a dotted acronym (``U.S.``).

As with punkt, whitespace between sentences is dropped unless ``keep_newlines`` is set, in which
case each sentence keeps the whitespace (newlines included) that follows it, so the sentences
concatenate back to the text.
"""

from __future__ import annotations

import re

ABBREVIATIONS = frozenset(
    """
    mr mrs ms dr prof sr jr st mt ft vs etc al fig figs eq eqs no nos vol vols pp ed eds gen col
    lt sgt capt cmdr rev hon gov sen rep pres inc ltd co corp dept univ assn bros approx est
    jan feb mar apr jun jul aug sep sept oct nov dec mon tue tues wed thu thur thurs fri sat sun
    e.g i.e cf viz ca a.m p.m u.s u.k ph.d b.a m.a b.sc m.sc
    """.split()
)

# A terminator run with its closing quotes/brackets, then either whitespace or (for full-width
# terminators, which CJK text does not follow with a space) anything.
_CANDIDATE = re.compile(r"""[.!?…]+["'”’»)\]]*(?=\s)|[。！？]+[」』”’)）]*""")
_SPACE = re.compile(r"\s*")
_OPENERS = "\"'“‘«([¿¡"


def _starts_sentence(text: str, at: int) -> bool:
    while at < len(text) and text[at] in _OPENERS:
        at += 1
    # Scripts without case (CJK, Arabic, ...) start sentences with letters that are not lower-case.
    return at < len(text) and not text[at].islower()


def _is_abbreviation(text: str, period: int) -> bool:
    """Whether the word ending at ``text[period] == '.'`` is an abbreviation or an initial."""
    start = period
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    word = text[start:period].lstrip(_OPENERS).lower()
    return len(word) == 1 and word.isalpha() or word in ABBREVIATIONS or "." in word.strip(".")


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    sentences, start = [], 0
    for match in _CANDIDATE.finditer(text):
        end = match.end()
        after = _SPACE.match(text, end).end()
        if after >= len(text):
            break
        full_width = match.group()[0] in "。！？"
        if not full_width:
            if not _starts_sentence(text, after):
                continue
            terminator = match.group().rstrip("\"'”’»)]")
            if terminator == "." and _is_abbreviation(text, match.start()):
                continue
        sentences.append(text[start:after] if keep_newlines else text[start:end])
        start = after
    sentences.append(text[start:])
    if keep_newlines:
        return [s for s in sentences if s]
    return [s for s in (s.strip() for s in sentences) if s]
