"""The text of a completion, whole or streamed piece by piece, with stop strings cut off.

A completion's text leaves out the stop token that ended it (an end of document is not text)
and everything from the first stop string on. Streaming must never send what the whole text
will not hold, so a piece is held back while it could still become a stop string or while it
ends inside a multi-byte character (the tokenizer's replacement character "\\ufffd").
"""

from __future__ import annotations

from collections.abc import Sequence

from mega.inference.stopping import StopRules, cut_at_stop_string

INCOMPLETE_CHARACTER = "\ufffd"


def completion_text(tokenizer, generated: Sequence[int], rules: StopRules) -> str:
    ids = list(generated)
    if ids and ids[-1] in rules.stop_ids:
        ids.pop()
    return cut_at_stop_string(tokenizer.detokenize(ids), rules.stop_strings) if ids else ""


class TextStream:
    """Feeds a completion's tokens one at a time and returns the text that is safe to send."""

    def __init__(self, tokenizer, rules: StopRules):
        self.tokenizer, self.rules = tokenizer, rules
        self.ids: list[int] = []
        self.sent = 0  # characters sent so far

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = completion_text(self.tokenizer, self.ids, self.rules)
        if text.endswith(INCOMPLETE_CHARACTER):
            return ""
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
