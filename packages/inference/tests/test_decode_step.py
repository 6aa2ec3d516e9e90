"""One decode step for every engine path: the one loop run to completion on the paged cache
(``lock_step`` below: what ``GenerationEngine.generate`` runs) and on the static KV cache, the
server's worker with its jobs, and the encoder-decoder engine give the same tokens,
log-probabilities and finish reasons for the same requests, cancels and stops included, with one
order of precedence (stop, then length, then cancel).

The encoder-decoder engine runs a decoder wrapped as an encoder-decoder model (the "encoder"
hands the prompt through, the "decoder" runs the decoder over prompt + generated tokens without
a cache) so its tokens can be compared with the decoder paths'; T5 itself is checked against
transformers in test_encoder_decoder.py."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import POSITIONS, hf_tiny, mega_from_hf  # noqa: E402

from mega.inference.engine import FinishReason, GenerationEngine, GenerationRequest  # noqa: E402
from mega.inference.engine.continuous import ContinuousBatchingWorker  # noqa: E402
from mega.inference.engine.encoder_decoder import EncoderDecoderEngine  # noqa: E402
from mega.inference.engine.host_copy import HostCopy, to_device  # noqa: E402
from mega.inference.engine.sampling import SamplingParams  # noqa: E402
from mega.inference.engine.stopping import StopRules  # noqa: E402
from mega.inference.engine.worker import Job  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    model, config = mega_from_hf(hf_tiny("llama"), "llama")
    return GenerationEngine(model, vocab_size=config.vocab_size, max_positions=POSITIONS)


class _PromptThrough(torch.nn.Module):
    """``encode`` keeps the prompt; ``decode`` runs the decoder over prompt + generated tokens."""

    def __init__(self, decoder: torch.nn.Module):
        super().__init__()
        self.decoder = decoder

    def encode(self, prompts: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return prompts.T  # [length, batch]: the engine selects rows on dimension 1

    def decode(self, tokens, encoder_output, encoder_padding, cache, logits_to_keep=None):
        cache.add(tokens)
        rows = []
        for row in range(tokens.shape[0]):
            prompt = encoder_output[:, row][encoder_padding[row]]
            ids = torch.cat([prompt, cache.generated[row]])[None]
            positions = torch.arange(ids.shape[1])[None]
            rows.append(self.decoder(ids, positions, inference_cache=None, logits_to_keep=1)[-1, 0])
        return torch.stack(rows)[None]


class _History:
    """The decoder tokens fed so far (the start token left out), one row per sequence."""

    def __init__(self, max_length: int):
        self.generated: torch.Tensor | None = None

    def add(self, tokens: torch.Tensor) -> None:
        self.generated = tokens[:, :0] if self.generated is None else torch.cat([self.generated, tokens], 1)

    def keep(self, rows: torch.Tensor) -> None:
        self.generated = self.generated[rows]


def requests(stop_token: int) -> tuple[list[GenerationRequest], dict[int, int]]:
    """The requests and, per request index, the generated token count at which its client cancels."""
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=3, frequency_penalty=0.5, logit_bias=((4, 2.0),))
    batch = [
        GenerationRequest([5, 17, 42, 8, 99, 3, 1], 10, logprobs=True, top_logprobs=2),
        GenerationRequest([7, 9], 12, sampling=sampled, logprobs=True),
        GenerationRequest([200, 13, 60], 14, sampling=SamplingParams(top_k=5, seed=11)),
        GenerationRequest(list(range(30, 50)), 15, logprobs=True),  # cancelled after 4 tokens
        GenerationRequest([11, 12], 4),  # cancelled at its last token: the length wins
        GenerationRequest([5, 17, 42, 8, 99, 3, 1], 10, stop=StopRules(stop_ids=frozenset({stop_token}))),
        # Cancelled at its stop token: the stop wins.
        GenerationRequest([5, 17, 42, 8, 99, 3, 1], 10, stop=StopRules(stop_ids=frozenset({stop_token}))),
        GenerationRequest([3, 4, 5], 0, logprobs=True),  # scoring only: no step at all
    ]
    return batch, {3: 4, 4: 4, 6: 3}


def canceller(batch: list[GenerationRequest], cancel_after: dict[int, int]):
    counts = [0] * len(batch)

    def on_token(index: int, *_) -> None:
        counts[index] += 1
        if counts[index] == cancel_after.get(index):
            batch[index].cancelled = True

    return on_token


def lock_step(engine, stop_token):
    batch, cancel_after = requests(stop_token)
    return engine.generate(batch, on_token=canceller(batch, cancel_after))


def static(engine, stop_token):
    batch, cancel_after = requests(stop_token)
    return engine.generate(batch, on_token=canceller(batch, cancel_after), static_cache=True)


def encoder_decoder(engine, stop_token):
    batch, cancel_after = requests(stop_token)
    batch = [r for r in batch if r.max_new_tokens]  # an encoder-decoder model generates at least one token
    seq2seq = EncoderDecoderEngine(_PromptThrough(engine.model), vocab_size=engine.vocab_size,
                                   max_positions=POSITIONS)
    seq2seq.cache_class = _History
    return seq2seq.generate(batch, on_token=canceller(batch, cancel_after))


def continuous(engine, stop_token):
    batch, cancel_after = requests(stop_token)
    on_token = canceller(batch, cancel_after)

    class CancellingJob(Job):  # the client reads each token as the worker hands it out
        def token(self, index, token, logprob, top=None):
            on_token(batch.index(self.requests[index]), token)
            super().token(index, token, logprob, top)

    worker = ContinuousBatchingWorker(engine, max_batch_size=8, max_num_tokens=512, block_size=8)

    async def run():
        loop = asyncio.get_running_loop()
        jobs = [CancellingJob([request], loop) for request in batch]
        for job in jobs:
            worker.submit(job)
        worker.start()
        return [(await job.done)[0] for job in jobs]

    try:
        return asyncio.run(run())
    finally:
        worker.stop()


def test_every_path_decodes_alike(engine):
    greedy = engine.generate([GenerationRequest([5, 17, 42, 8, 99, 3, 1], 10)])[0].generated
    stop_token = greedy[2]  # the greedy request stops at its third token
    assert stop_token not in greedy[:2]
    expected = lock_step(engine, stop_token)
    reasons = [r.finish_reason for r in expected]
    assert reasons == ["length", "length", "length", "cancelled", "length", "stop", "stop", "length"]
    assert all(isinstance(reason, FinishReason) for reason in reasons)
    assert [len(r.generated) for r in expected] == [10, 12, 14, 4, 4, 3, 3, 0]
    for path in (static, continuous, encoder_decoder):
        got = path(engine, stop_token)
        compared = [r for r in expected if r.generated or path is not encoder_decoder]
        assert [r.tokens for r in got] == [r.tokens for r in compared], path.__name__
        assert [r.finish_reason for r in got] == [r.finish_reason for r in compared], path.__name__
        for want, have in zip(compared, got, strict=True):
            if want.logprobs is None:
                assert have.logprobs is None
                continue
            # The encoder-decoder engine scores generated tokens only (the decoder sees no prompt).
            count = len(want.generated) if path is encoder_decoder else len(want.logprobs)
            assert len(have.logprobs) == len(want.logprobs), path.__name__
            torch.testing.assert_close(torch.tensor(have.logprobs[len(have.logprobs) - count:]),
                                       torch.tensor(want.logprobs[len(want.logprobs) - count:]), atol=1e-5, rtol=0)
            if want.top_logprobs is not None:
                assert [[t for t, _ in top] for top in have.top_logprobs[len(have.top_logprobs) - count:]] == \
                       [[t for t, _ in top] for top in want.top_logprobs[len(want.top_logprobs) - count:]]


def counting(engine: GenerationEngine, lag: int) -> tuple[GenerationEngine, list[int]]:
    """An engine on ``engine``'s model reading tokens ``lag`` steps late, and its forwards' count."""
    lagged = GenerationEngine(engine.model, vocab_size=engine.vocab_size, max_positions=POSITIONS, read_lag=lag)
    forwards, forward = [], lagged.forward
    lagged.forward = lambda *args, **kwargs: forwards.append(1) or forward(*args, **kwargs)
    return lagged, forwards


def test_tokens_read_late_end_where_read_at_once(engine):
    """CPU. The host reads each step's tokens ``read_lag`` steps after the device chose them: a
    stop found at step t is learnt late, the row keeps decoding meanwhile, and nothing after t is
    returned or streamed. Against reading every step at once (lag 0), on the lock-step and the
    static paths; a batch-mate that goes on is not disturbed."""
    greedy = engine.generate([GenerationRequest([5, 17, 42, 8, 99, 3, 1], 10)])[0].generated
    stop = StopRules(stop_ids=frozenset({greedy[2]}))

    def run(lag: int, path: str, sampled: bool):
        lagged, forwards = counting(engine, lag)
        batch = [GenerationRequest([5, 17, 42, 8, 99, 3, 1], 10, stop=stop, logprobs=True)]
        if sampled:
            batch.append(GenerationRequest([7, 9], 12, SamplingParams(temperature=0.8, seed=5), logprobs=True))
        streamed = [[] for _ in batch]
        on_token = lambda index, token, *_: streamed[index].append(token)  # noqa: E731
        results = lagged.generate(batch, on_token=on_token, static_cache=path == "static")
        return results, len(forwards), streamed

    for path in ("lock-step", "static"):
        (at_once, forwards_at_once, streamed_at_once), (late, forwards_late, streamed_late) = (
            run(0, path, sampled=True), run(3, path, sampled=True))
        assert [r.finish_reason for r in late] == ["stop", "length"], path
        assert late[0].generated == greedy[:3] and streamed_late == streamed_at_once == [greedy[:3], late[1].generated]
        assert [r.tokens for r in late] == [r.tokens for r in at_once], path
        for want, have in zip(at_once, late, strict=True):  # batches of other sizes: last bits may differ
            torch.testing.assert_close(torch.tensor(have.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
        assert forwards_late == forwards_at_once, path  # the row past its stop rode along with its batch-mate
        # Alone, the stopped row decodes 3 steps past its stop before the host learns of it.
        (at_once, forwards_at_once, _), (late, forwards_late, streamed_late) = (
            run(0, path, sampled=False), run(3, path, sampled=False))
        assert late[0].generated == at_once[0].generated == streamed_late[0] == greedy[:3], path
        assert late[0].finish_reason == "stop" and late[0].logprobs == at_once[0].logprobs, path
        assert (forwards_at_once, forwards_late) == (3, 6), path  # prefill + 2 decode steps, + the overshoot


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA: pinned buffers, non-blocking copies and an event"))])
def test_host_copy_reads_what_the_device_held_then(device):
    """CPU, and CUDA where there is one (the copy a decode step leaves behind runs in the
    stream's order: a later write on the device does not reach it)."""
    tensor = torch.arange(5, device=device) * 3
    copy = HostCopy({"ids": tensor, "halves": tensor.float() / 2})
    tensor.add_(100)
    assert copy.read() == {"ids": [0, 3, 6, 9, 12], "halves": [0.0, 1.5, 3.0, 4.5, 6.0]}
    assert to_device([1, 2], torch.device(device)).tolist() == [1, 2]
