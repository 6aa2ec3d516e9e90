"""When a sequence stops: stop tokens, stop strings, and Megatron's end-of-line rules.

Megatron's ``stop_on_eol`` stops at a GPT-2 newline token (ids 198 "\\n" and 628 "\\n\\n") and
``stop_on_double_eol`` at "\\n\\n" or two "\\n" tokens in a row. Written for any tokenizer, that
is: a generated token whose text holds a newline, and a newline pair across the last two tokens.
The stop tokens (the tokenizer's end of document unless a request names another) always stop,
with or without those rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Tokens decoded to look for a stop string: its length in characters (a token is at least one
# character nearly always) plus a margin for tokens that decode to nothing on their own.
STOP_STRING_MARGIN_TOKENS = 8


@dataclass(frozen=True)
class StopRules:
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False

    @property
    def needs_text(self) -> bool:
        return bool(self.stop_strings) or self.stop_on_eol or self.stop_on_double_eol


class StopChecker:
    """Applies :class:`StopRules` to generated ids, with the tokenizer's text where rules need it."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}

    def token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.detokenize([token])
        return text

    def should_stop(self, rules: StopRules, generated: Sequence[int]) -> bool:
        """Whether the last of ``generated`` (this sequence's new ids so far) ends it."""
        token = generated[-1]
        if token in rules.stop_ids:
            return True
        if not rules.needs_text:
            return False
        if self.tokenizer is None:
            raise ValueError("stop strings and end-of-line rules need a tokenizer")
        if rules.stop_on_eol and "\n" in self.token_text(token):
            return True
        if rules.stop_on_double_eol:
            previous = self.token_text(generated[-2]) if len(generated) > 1 else ""
            if "\n\n" in previous + self.token_text(token):
                return True
        if rules.stop_strings:
            window = max(map(len, rules.stop_strings)) + STOP_STRING_MARGIN_TOKENS
            text = self.tokenizer.detokenize(list(generated[-window:]))
            return any(stop in text for stop in rules.stop_strings)
        return False


def cut_at_stop_string(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` up to the first stop string it holds (the stop string itself left out)."""
    positions = [index for index in (text.find(stop) for stop in stop_strings) if index >= 0]
    return text[: min(positions)] if positions else text
