"""Sampling filters, stop rules (Megatron's end-of-line rules for any tokenizer) and the text a
streamed completion may send."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mega.inference.completion_text import TextStream, completion_text
from mega.inference.engine.sampling import Sampler, SamplingError, SamplingParams
from mega.inference.engine.stopping import StopChecker, StopRules, cut_at_stop_string


class ByteTokenizer:
    """Each id is some bytes, as in byte-level BPE: 7 and 8 are the two halves of "é"; 9 is an
    end of document (no text)."""

    pieces = [b"a", b"b", b"\n", b"c", b" ", b"d", b".", b"\xc3", b"\xa9", b""]

    def detokenize(self, ids):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def draw(params: SamplingParams, logits: torch.Tensor, n: int) -> torch.Tensor:
    sampler = Sampler([dataclasses.replace(params, seed=i) for i in range(n)], torch.device("cpu"))
    return sampler.sample(logits.expand(n, -1), [True] * n)


def test_top_k_and_top_p_keep_only_the_likely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    assert set(draw(SamplingParams(top_k=2, seed=0), logits, 400).tolist()) == {0, 1}
    # top_p 0.7: tokens 0 (0.5) and 1 (0.25) reach it; 2 and 3 go.
    assert set(draw(SamplingParams(top_p=0.7, seed=0), logits, 400).tolist()) == {0, 1}
    # top_p below the most likely token's probability keeps that token alone.
    assert set(draw(SamplingParams(top_p=0.1, seed=0), logits, 50).tolist()) == {0}
    tokens = draw(SamplingParams(seed=0), logits, 4000)
    frequencies = torch.bincount(tokens, minlength=4) / 4000
    assert torch.allclose(frequencies, torch.tensor([0.5, 0.25, 0.15, 0.1]), atol=0.03)
    # A low temperature sharpens towards the most likely token.
    assert (draw(SamplingParams(temperature=0.05, seed=0), logits, 200) == 0).all()


def test_sampling_settings_are_checked():
    for bad in (dict(temperature=0.0), dict(top_k=-1), dict(top_p=1.5)):
        with pytest.raises(SamplingError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_stop_rules():
    checker = StopChecker(ByteTokenizer())
    eod = StopRules(stop_ids=frozenset({9}))
    assert checker.should_stop(eod, [0, 9]) and not checker.should_stop(eod, [0, 1])
    eol = StopRules(stop_on_eol=True)
    assert checker.should_stop(eol, [0, 2]) and not checker.should_stop(eol, [0, 1])
    double = StopRules(stop_on_double_eol=True)
    assert checker.should_stop(double, [2, 2]) and not checker.should_stop(double, [2, 0, 2])
    strings = StopRules(stop_strings=("c d",))
    assert checker.should_stop(strings, [0, 3, 4, 5]) and not checker.should_stop(strings, [0, 3, 4])
    with pytest.raises(ValueError, match="need a tokenizer"):
        StopChecker().should_stop(eol, [2])


def test_completion_text_leaves_out_stop_tokens_and_strings():
    tokenizer = ByteTokenizer()
    assert completion_text(tokenizer, [0, 1, 9], StopRules(stop_ids=frozenset({9}))) == "ab"
    assert completion_text(tokenizer, [0, 3, 4, 5, 1], StopRules(stop_strings=("c d",))) == "a"
    assert cut_at_stop_string("xx END yy STOP", ["STOP", " END"]) == "xx"


def test_streamed_pieces_hold_back_possible_stop_strings_and_half_characters():
    rules = StopRules(stop_ids=frozenset({9}), stop_strings=("c d.",))
    stream = TextStream(ByteTokenizer(), rules)
    pieces = [stream.push(token) for token in (0, 3, 4, 5, 1)]  # "ac d" could become "c d."
    assert pieces == ["a", "", "", "", "c db"]
    stream = TextStream(ByteTokenizer(), rules)
    pieces = [stream.push(token) for token in (0, 7, 8, 1, 9)] + [stream.finish()]
    assert pieces == ["a", "", "é", "b", "", ""]
    stream = TextStream(ByteTokenizer(), rules)
    assert [stream.push(t) for t in (0, 3, 4)] + [stream.finish()] == ["a", "", "", "c "]


class WordStartTokenizer:
    """SentencePiece's convention: "▁" marks a word start and becomes a space, except at the start
    of the text; the pieces of "ü" are split over ids 4 and 5. Records how many ids each decode
    gets."""

    pieces = ["\u2581the", "\u2581cat", "s", ".", b"\xc3", b"\xbc", "\u2581"]

    def __init__(self):
        self.decoded_lengths = []

    def detokenize(self, ids):
        self.decoded_lengths.append(len(ids))
        data = b"".join(p if isinstance(p, bytes) else p.encode() for p in (self.pieces[i] for i in ids))
        return data.decode("utf-8", errors="replace").replace("\u2581", " ").removeprefix(" ")


def test_streamed_text_is_the_whole_text_and_decodes_only_the_last_tokens():
    import random

    chooser = random.Random(0)
    for _ in range(50):
        ids = []
        for _ in range(chooser.randrange(1, 300)):
            ids += [4, 5] if chooser.random() < 0.2 else [chooser.randrange(4) if chooser.random() < 0.9 else 6]
        rules = StopRules(stop_strings=("cats.",) if chooser.random() < 0.5 else ())
        stream = TextStream(tokenizer := WordStartTokenizer(), rules)
        streamed = "".join(stream.push(token) for token in ids)
        tokenizer.decoded_lengths.clear()
        assert streamed + stream.finish() == completion_text(tokenizer, ids, rules)
        stream = TextStream(tokenizer := WordStartTokenizer(), rules)
        for token in ids:
            stream.push(token)
        assert max(tokenizer.decoded_lengths) <= 4, "a push decodes a few tokens, not the whole completion"


def test_logit_bias_and_penalties_follow_openais_formula():
    params = [SamplingParams(top_k=1, logit_bias=((2, 5.0),), presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(top_k=1)]
    sampler = Sampler(params, torch.device("cpu"))
    logits = torch.zeros(2, 4)
    assert sampler.sample(logits, [True, True]).tolist() == [2, 0]  # the bias decides; row 1 untouched
    for tokens in ([2, 0], [2, 1], [3, 1]):
        sampler.observe(torch.tensor(tokens), [True, False])  # row 1 is still in its prompt: not counted
    counts = torch.tensor([[0.0, 0.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    expected = torch.tensor([[0.0, 0.0, 5.0, 0.0], [0.0] * 4]) - 0.5 * (counts > 0) - 0.25 * counts
    assert torch.allclose(sampler.adjust(logits), expected)
    # Rows that join later keep their own state; rows that leave take theirs along.
    sampler.extend(Sampler([SamplingParams(top_k=1, frequency_penalty=1.0)], torch.device("cpu")))
    sampler.keep([0, 2])
    assert torch.allclose(sampler.adjust(torch.zeros(2, 4))[0], expected[0])
    assert torch.allclose(sampler.adjust(torch.zeros(2, 4))[1], torch.zeros(4))
    with pytest.raises(SamplingError, match="seed"):
        SamplingParams(seed=2**64)
