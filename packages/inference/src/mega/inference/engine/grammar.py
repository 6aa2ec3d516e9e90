"""Structured outputs: a grammar per sequence that masks its logits, so every token it takes keeps
the text a prefix of the language (a JSON schema, any JSON object, a regular expression, one of
some choices).

The grammar engine is llguidance (PyPI ``llguidance``: a Rust core, no Python dependencies):
chosen over xgrammar, which brings torch, transformers and triton with it, by measurement on this
CPU (docs/benchmarks.md: the mask of a nested JSON schema over a 50k vocabulary in tens of
microseconds per token, the compile of a schema in milliseconds without a per-vocabulary
preprocessing pass).

A constraint is compiled once per request (:class:`GrammarCompiler`, which refuses what the
engine cannot compile, naming the part); each sequence of the request gets its own matcher
(:class:`GrammarState`). The decode step (:class:`~mega.inference.engine.decode_step.DecodeStep`)
asks :func:`mask_logits` for the constrained rows of a step before sampling (the other rows
untouched), and advances each matcher with the token its row took (:func:`advance`). The end of
document is allowed only where the grammar is complete, so a constrained sequence ends by
itself with a complete text or at its length (``finish_reason`` ``length``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy
import torch


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile; the message names the part."""


# JSON on one line, items and keys separated as Python's json.dumps does: whitespace the model may
# repeat without end (flexible layout) would let a weak model fill its length with newlines.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What a request constrains its text to: ``kind`` is ``json_schema`` (``value`` the schema),
    ``json_object`` (any JSON object), ``regex`` (a pattern the whole text matches), ``choice``
    (one of ``value``'s strings) or ``lark`` (llguidance's Lark grammar, ``%json`` included)."""

    kind: str
    value: object = None

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (not compiled yet)."""

        if self.kind in ("json_schema", "json_object"):
            schema = self.value if self.kind == "json_schema" else {"type": "object"}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.value)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in self.value))
        raise GrammarError(f"unknown constraint kind {self.kind!r}")


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint: each sequence starts its own :class:`GrammarState` from it."""

    compiled: str
    tokenizer: object  # llguidance.LLTokenizer

    def start(self) -> GrammarState:

        return GrammarState(llguidance.LLMatcher(self.tokenizer, self.compiled, log_level=0))


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, matcher):
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The allowed next tokens into ``bitmask[row]`` (int32 words, bit ``t % 32`` of word
        ``t // 32`` for token ``t``)."""
        words = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def accept(self, token: int) -> None:
        # A token outside the mask cannot be taken (its logit is -inf), unless the mask had no
        # token left; the matcher then records an error and allows only the end of document.
        self.matcher.consume_token(token)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary (the model's logits' width), from
    which llguidance reads every token's bytes: a Hugging Face ``tokenizers`` object
    (``reference``: mega-data's Hugging Face and GPT-2 BPE tokenizers) or a tiktoken encoding
    (``encoding``: its TikTokenizer)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._llg_tokenizer = None

    @property
    def llg_tokenizer(self):
        if self._llg_tokenizer is None:

            reference = getattr(self.tokenizer, "reference", None)
            encoding = getattr(self.tokenizer, "encoding", None)
            if reference is not None and hasattr(reference, "to_str"):
                source = reference.to_str()
            elif encoding is not None and hasattr(encoding, "decode_single_token_bytes"):
                source = llguidance.TokenizerWrapper(_TiktokenTokens(self.tokenizer, self.vocab_size))
            else:
                raise GrammarError(f"structured outputs need the tokens' bytes, which {type(self.tokenizer).__name__} "
                                   "does not give (a Hugging Face, GPT-2 BPE or tiktoken tokenizer does)")
            self._llg_tokenizer = llguidance.LLTokenizer(source, n_vocab=self.vocab_size, eos_token=self.tokenizer.eod)
        return self._llg_tokenizer

    def compile(self, constraint: Constraint, part: str) -> Grammar:
        """``constraint``'s grammar, checked; a :class:`GrammarError` naming ``part`` (the request
        field) and the engine's reason where it cannot compile."""

        try:
            grammar = constraint.grammar()
        except (ValueError, TypeError) as error:
            raise GrammarError(f"{part}: {error}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.llg_tokenizer)
        if failed:
            raise GrammarError(f"{part}: the grammar engine cannot compile it: {messages[0]}")
        return Grammar(grammar, self.llg_tokenizer)


class _TiktokenTokens:
    """A tiktoken tokenizer as llguidance's ``TokenizerWrapper`` reads one: each id's bytes (the
    special tokens' text), the special ids, and an encoder of bytes."""

    def __init__(self, tokenizer, vocab_size: int):
        encoding = tokenizer.encoding
        special = set(getattr(tokenizer, "special_tokens", {}).values())
        self.tokens = []
        for token in range(vocab_size):
            try:
                self.tokens.append(encoding.decode_single_token_bytes(token))
            except KeyError:  # an id the encoding leaves out (padding of the vocabulary)
                self.tokens.append(b"")
                special.add(token)
        self.special_token_ids = sorted(special)
        self.eos_token_id, self.bos_token_id = tokenizer.eod, getattr(tokenizer, "bos", None)
        self._encoding = encoding

    def __call__(self, text: bytes) -> list[int]:
        return self._encoding.encode(text.decode("utf-8", errors="replace"), disallowed_special=())


def mask_logits(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` with the tokens each constrained row's grammar forbids at
    ``-inf`` (rows whose state is None as they are)."""
    rows = [row for row, state in enumerate(states) if state is not None]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    bitmask = torch.empty(len(rows), (vocab + 31) // 32, dtype=torch.int32)
    for k, row in enumerate(rows):
        states[row].fill(bitmask, k)
    if logits.device.type == "cpu":  # bits to booleans in one C loop (little-endian words: token order)
        allowed = torch.from_numpy(numpy.unpackbits(bitmask.numpy().view(numpy.uint8), axis=1, bitorder="little"))
        allowed = allowed[:, :vocab].bool()
    else:
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        bits = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab]  # [constrained rows, vocab]
    if len(rows) == len(states):
        return logits.masked_fill(~allowed, float("-inf"))
    index = torch.tensor(rows, device=logits.device)
    masked = logits.clone()
    masked[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return masked


def advance(chosen: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
    """Each constrained row's grammar takes the token ``chosen`` ``[rows]`` gave it (read on the
    host now: the next step's mask needs it)."""
    rows = [row for row, state in enumerate(states) if state is not None]
    if not rows:
        return
    tokens = chosen[torch.tensor(rows, device=chosen.device)].tolist()
    for row, token in zip(rows, tokens, strict=True):
        states[row].accept(token)
