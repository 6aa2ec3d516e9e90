"""Megatron's zero-shot evaluations (``tasks/main.py``): WikiText perplexity and LAMBADA accuracy.

Perplexity uses Megatron's overlapping windows: window ``i`` starts at token ``i * overlap``
and holds ``seq_length + 1`` tokens (inputs and shifted labels); the first window scores all
its labels, each later one only its last ``overlap`` labels (the rest were scored before, with
less context). The loss summed over the scored labels, divided by ``tokens - 1``, is the
token-level loss; ``ppl = exp(min(20, loss))``; the word-level ("adjusted") perplexity scales
the loss by ``(tokens - 1) / (words - 1)``, where ``words`` counts the original text's
space-separated pieces.

LAMBADA: the last word of each passage is predicted from the rest, and a passage counts as
correct when the greedy choice is right at every one of the word's tokens. Non-strict, the
word is the passage's last token; strict, it is the last whitespace-separated word, tokenized
with its leading space apart from the context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mega.core.parallel.collectives import gather_along


@dataclass(frozen=True)
class Window:
    tokens: list[int]  # inputs and the label after the last: at most seq_length + 1
    scored_from: int  # the first label (index into tokens[1:]) that counts


def overlapping_windows(tokens: Sequence[int], seq_length: int, overlap: int | None = None) -> list[Window]:
    """Megatron's ``_LMDataset`` windows over ``tokens`` (no padding: each window keeps its
    real length, so nothing beyond the text is scored)."""
    overlap = max(1, seq_length if overlap is None else overlap)
    targets = max(len(tokens) - 1 - overlap, 0)
    count = max(math.ceil(targets / overlap) + 1, 1)
    windows = []
    for index in range(count):
        start = index * overlap
        window = list(tokens[start: start + seq_length + 1])
        labels = len(window) - 1
        # Later windows score only their last `overlap` positions of a full window.
        scored_from = 0 if index == 0 or overlap == seq_length else max(seq_length - overlap, 0)
        if labels > scored_from:
            windows.append(Window(window, scored_from))
    return windows


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    return model(tokens, positions)  # [seq, batch, vocab (shard)]


@torch.inference_mode()
def window_loss(model, windows: Sequence[Window], device: torch.device, tp_group=None,
                batch_size: int = 8) -> float:
    """The summed negative log-likelihood of every window's scored labels."""
    total = 0.0
    by_length: dict[int, list[Window]] = {}
    for window in windows:
        by_length.setdefault(len(window.tokens), []).append(window)
    for group in by_length.values():
        for start in range(0, len(group), batch_size):
            batch = group[start: start + batch_size]
            tokens = torch.tensor([w.tokens for w in batch], device=device)
            losses = model.loss(_logits(model, tokens[:, :-1]), tokens[:, 1:], tp_group).double()  # [b, s]
            for row, window in enumerate(batch):
                total += losses[row, window.scored_from:].sum().item()
    return total


def perplexity(model, tokenizer, text: str, seq_length: int, overlap: int | None, device: torch.device,
               tp_group=None, batch_size: int = 8) -> dict:
    """Megatron's WIKITEXT103 evaluation of ``text`` (see the module's docstring)."""
    original_tokens = len(text.strip().split(" "))
    tokens = tokenizer.tokenize(text)
    if len(tokens) < 2:
        raise ValueError(f"the text holds {len(tokens)} token(s): perplexity needs at least 2")
    loss_sum = window_loss(model, overlapping_windows(tokens, seq_length, overlap), device, tp_group, batch_size)
    loss = loss_sum / (len(tokens) - 1)
    token_ratio = (len(tokens) - 1) / max(original_tokens - 1, 1)
    return {"task": "wikitext-ppl", "loss": loss, "ppl": math.exp(min(20.0, loss)),
            "adjusted_ppl": math.exp(min(20.0, loss * token_ratio)), "token_ratio": token_ratio,
            "num_tokenized_tokens": len(tokens), "num_original_tokens": original_tokens,
            "seq_length": seq_length, "overlapping_eval": overlap or seq_length}


def lambada_example(tokenizer, text: str, strict: bool) -> tuple[list[int], list[int]]:
    """(context, last word) token ids of a passage, Megatron's way."""
    if not strict:
        tokens = tokenizer.tokenize(text)
        return tokens[:-1], tokens[-1:]
    last_word = text.split()[-1]
    start = text.rfind(last_word)
    return tokenizer.tokenize(text[:start].strip()), tokenizer.tokenize(" " + last_word)


@torch.inference_mode()
def lambada_accuracy(model, tokenizer, texts: Sequence[str], strict: bool, vocab_size: int, seq_length: int,
                     device: torch.device, tp_group=None) -> dict:
    correct = 0
    for number, text in enumerate(texts):
        context, word = lambada_example(tokenizer, text, strict)
        tokens = (context + word)[-(seq_length + 1):]
        if not context or not word:
            raise ValueError(f"passage {number + 1} has no context or no last word to predict")
        inputs = torch.tensor([tokens[:-1]], device=device)
        logits = _logits(model, inputs)[:, 0]
        if tp_group is not None and tp_group.size > 1:
            logits = gather_along(logits, tp_group, dim=-1)
        predicted = logits[-len(word):, :vocab_size].argmax(dim=-1).tolist()
        correct += predicted == tokens[-len(word):]
    return {"task": "lambada", "strict": strict, "examples": len(texts), "correct": correct,
            "accuracy": correct / len(texts) if texts else 0.0}
