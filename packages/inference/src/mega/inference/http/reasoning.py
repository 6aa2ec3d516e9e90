"""Reasoning text: what a reasoning model writes between ``<think>`` and ``</think>`` goes to
``reasoning_content``, the rest to ``content`` (``--reasoning-parser``, or a chat template that
writes ``<think>`` itself). A template that opens the think block in the prompt (Qwen3's with
thinking, DeepSeek-R1's) leaves the model's answer starting inside it: the text before a
``</think>`` with no ``<think>`` before it is reasoning too.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def opened_by(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves the answer inside a think block."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def split(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer (``opened``: it starts inside the block)."""
    stripped = text.lstrip()
    if not opened and not stripped.startswith(THINK_OPEN):
        return None, text
    if not opened:
        stripped = stripped[len(THINK_OPEN):]
    if THINK_CLOSE not in stripped:  # cut inside its reasoning (at its length)
        return stripped.strip(), ""
    reasoning, content = stripped.split(THINK_CLOSE, 1)
    return reasoning.strip(), content.lstrip()


class ReasoningStream:
    """Streamed pieces of text sorted into reasoning and content deltas; a piece that may be the
    start of a tag is held back until the next says."""

    def __init__(self, opened: bool = False):
        self.inside: bool | None = True if opened else None  # None: the answer's start not seen yet
        self.held = ""

    def push(self, piece: str) -> list[tuple[str, str]]:
        """(field, text) deltas: field is ``reasoning_content`` or ``content``."""
        text, self.held, out = self.held + piece, "", []
        if self.inside is None:
            stripped = text.lstrip()
            if len(stripped) < len(THINK_OPEN) and THINK_OPEN.startswith(stripped):
                self.held = text
                return out
            self.inside = stripped.startswith(THINK_OPEN)
            text = stripped[len(THINK_OPEN):] if self.inside else text
        if not self.inside:
            return [("content", text)] if text else []
        if THINK_CLOSE in text:
            before, after = text.split(THINK_CLOSE, 1)
            self.inside = False
            out = [("reasoning_content", before)] if before else []
            after = after.lstrip()
            return out + ([("content", after)] if after else [])
        keep = next((len(text) - i for i in range(len(text)) if THINK_CLOSE.startswith(text[i:])), 0)
        self.held = text[len(text) - keep:]
        return [("reasoning_content", text[: len(text) - keep])] if len(text) > keep else []

    def finish(self) -> list[tuple[str, str]]:
        held, self.held = self.held, ""
        if not held:
            return []
        return [("reasoning_content" if self.inside else "content", held)]
