"""How many characters one token can stand for: the bound of the character pre-check.

A prompt of ``c`` characters is at least ``c / longest_token_chars`` tokens, so one longer than
the model's positions times that cannot fit, and is refused before the tokenizer sees it:
tokenizing megabytes holds the interpreter for seconds (the fast tokenizers keep the GIL in
``encode``) and leaves hundreds of megabytes of allocator arenas behind.
"""

from __future__ import annotations

import threading

from mega.inference.http.errors import RequestError


def longest_token_chars(tokenizer) -> int:
    """The most characters any token adds to a text: each token's text written twice, so what
    a detokenizer puts between tokens (a space) counts too; at least 1."""
    longest = 1
    for token in range(tokenizer.vocab_size):
        try:
            longest = max(longest, len(tokenizer.detokenize([token, token])))
        except (ValueError, KeyError, IndexError):  # an id the tokenizer has no text for
            continue
    return longest


class PromptCharLimit:
    """Refuses a text longer than ``positions`` times :func:`longest_token_chars` (worked out
    once, on first need: call :meth:`check` off the event loop)."""

    def __init__(self, tokenizer, positions: int):
        self.tokenizer, self.positions = tokenizer, positions
        self.token_chars: int | None = None
        self._lock = threading.Lock()

    def check(self, text: str, param: str, where: str | None = None, what: str | None = None) -> None:
        """400 naming ``param`` (the message says ``where``, e.g. ``prompt[3]``) for a text that
        cannot fit ``what`` (by default the tokens of ``--max-model-len``)."""
        if len(text) <= self.positions:  # short enough that only its tokens can tell
            return
        with self._lock:
            if self.token_chars is None:
                self.token_chars = longest_token_chars(self.tokenizer)
        if len(text) > self.positions * self.token_chars:
            what = what or f"the {self.positions} tokens of --max-model-len"
            raise RequestError(f"{where or param}: {len(text)} characters cannot fit {what} (a token stands for at "
                               f"most {self.token_chars} characters)", param)
