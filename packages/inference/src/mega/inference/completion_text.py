"""The text of a completion, whole or streamed piece by piece, with stop strings cut off.

A completion's text leaves out the stop token that ended it (an end of document is not text)
and everything from the first stop string on. Streaming must never send what the whole text
will not hold, so a piece is held back while it could still become a stop string or while it
ends inside a multi-byte character (the tokenizer's replacement character "\\ufffd").
"""

from __future__ import annotations

from collections.abc import Sequence

from mega.inference.engine.stopping import StopRules, cut_at_stop_string

INCOMPLETE_CHARACTER = "\ufffd"


def completion_text(tokenizer, generated: Sequence[int], rules: StopRules) -> str:
    ids = list(generated)
    if ids and ids[-1] in rules.stop_ids:
        ids.pop()
    return cut_at_stop_string(tokenizer.detokenize(ids), rules.stop_strings) if ids else ""


def tokens_covering(tokenizer, ids: Sequence[int], length: int) -> int:
    """The fewest of ``ids`` whose text holds the first ``length`` characters of theirs: after a
    stop string cuts a completion's text, its tokens (and their logprobs) end there too. By
    decoding prefixes (a binary search), so characters split over tokens count right."""
    if length <= 0:
        return 0
    low, high = 1, len(ids)
    while low < high:
        middle = (low + high) // 2
        if len(tokenizer.detokenize(list(ids[:middle]))) >= length:
            high = middle
        else:
            low = middle + 1
    return high


class TextStream:
    """Feeds a completion's tokens one at a time and returns the text that is safe to send.

    Each push decodes only the last few tokens: the new token with the one or two before it, as
    context for tokenizers whose pieces change at a word start (SentencePiece's leading space) and
    for characters split over tokens. Re-decoding the whole completion per token would be
    quadratic in its length.
    """

    def __init__(self, tokenizer, rules: StopRules):
        self.tokenizer, self.rules = tokenizer, rules
        self.ids: list[int] = []
        self.text = ""  # the decoded text of ids[:settled]
        self.context = 0  # ids[context:settled] are decoded again with each new token
        self.settled = 0
        self.sent = 0  # characters sent so far

    def push(self, token: int) -> str:
        self.ids.append(token)
        if token in self.rules.stop_ids:
            return ""  # ends the completion and is no text
        window = self.tokenizer.detokenize(self.ids[self.context:])
        if window.endswith(INCOMPLETE_CHARACTER):
            return ""  # the rest of the character is in tokens still to come
        before = self.tokenizer.detokenize(self.ids[self.context:self.settled])
        self.text += window[len(before):]
        self.context, self.settled = self.settled, len(self.ids)
        text = cut_at_stop_string(self.text, self.rules.stop_strings)
        return self._send(text[: len(text) - _held_back(text, self.rules.stop_strings)])

    def finish(self) -> str:
        """What is left once the completion has ended."""
        return self._send(completion_text(self.tokenizer, self.ids, self.rules))

    def _send(self, text: str) -> str:
        piece = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return piece


def _held_back(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that begins some stop string."""
    longest = 0
    for stop in stop_strings:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
