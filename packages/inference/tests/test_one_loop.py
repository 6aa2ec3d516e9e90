"""One decoder loop behind every entry point (issue 46). Runs on CPU (pinned: ``--device cpu``).

- ``mega generate`` on a batch of prompts returns the tokens and log-probabilities ``mega serve``
  gives the same requests (Megatron's ``PUT /api``, whose seeds follow the same rule: prompt i
  draws from seed + i), greedy and seeded sampling; both are the whole commands' ``main`` on one
  tiny LLaMA directory.
- Cancellation goes through the one rule (stop, then length, then cancellation) wherever it
  happens: in the queue, after the prompt, at a token that also stops or reaches the length;
  through :meth:`GenerationEngine.generate` (``mega generate``'s loop), the server's worker and
  T5's loop; a failing T5 batch answers its jobs.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from in_process_server import serving  # noqa: E402
from tiny_models import POSITIONS, VOCAB, hf_tiny, mega_from_hf  # noqa: E402

from mega.inference.engine import FinishReason, GenerationEngine, GenerationRequest  # noqa: E402
from mega.inference.engine.continuous import ContinuousBatchingWorker  # noqa: E402
from mega.inference.engine.requests import ending  # noqa: E402
from mega.inference.engine.sampling import SamplingParams  # noqa: E402
from mega.inference.engine.stopping import StopRules  # noqa: E402

PROMPTS = ["5 17 42 8 99", "7 9", "1 2 3 4 5 6 7 8 9 10 11"]
NEW_TOKENS = 8
# The model's ids as text (NullTokenizer: "5 17 42"); its end of document VOCAB - 1 stops both commands.
TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    hf_tiny("llama").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def served(llama_dir):
    """A function sending a ``PUT /api`` body to ``mega serve``'s whole ``main`` on ``llama_dir``,
    running in this process (:mod:`in_process_server`)."""
    with serving(["--load", str(llama_dir), "--device", "cpu", *TOKENIZER]) as send:
        yield lambda body: send("PUT", "/api", body)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_generate_equals_serve(llama_dir, served, sampling, capsys):
    from mega.inference.cli.generate import main as generate_main

    flags = ["--greedy"] if sampling == "greedy" else ["--temperature", "0.8", "--top-k", "20", "--seed", "11"]
    argv = ["--load", str(llama_dir), "--device", "cpu", *TOKENIZER, "--max-tokens", str(NEW_TOKENS), "--json",
            "--logprobs", *flags, *(arg for prompt in PROMPTS for arg in ("--prompt", prompt))]
    assert generate_main(argv) == 0
    generated = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    body = {"prompts": PROMPTS, "tokens_to_generate": NEW_TOKENS, "logprobs": True}
    body.update({"top_k": 1} if sampling == "greedy" else {"temperature": 0.8, "top_k": 20, "random_seed": 11})
    reply = served(body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert [g["prompt"] for g in generated] == PROMPTS
    for prompt, mine, tokens, logprobs in zip(PROMPTS, generated, answer["tokens"], answer["logprobs"], strict=True):
        prompt_length = len(prompt.split())
        assert mine["tokens"] == tokens[prompt_length:], prompt
        # mega generate prints the generated tokens' log-probabilities; /api those of every token
        # after the first.
        torch.testing.assert_close(torch.tensor(mine["logprobs"]), torch.tensor(logprobs[prompt_length - 1:]),
                                   atol=1e-5, rtol=0)
    if sampling == "seeded":  # the seeds drew something else than the greedy choice somewhere
        greedy = served({**body, "top_k": 1, "temperature": 1.0}).json()
        assert greedy["tokens"] != answer["tokens"]


def test_the_one_rule_orders_stop_length_cancel():
    assert ending(stopped=True, at_length=True, cancelled=True) == FinishReason.STOP
    assert ending(stopped=False, at_length=True, cancelled=True) == FinishReason.LENGTH
    assert ending(stopped=False, at_length=False, cancelled=True) == FinishReason.CANCELLED
    assert ending(stopped=False, at_length=False, cancelled=False) is None


@pytest.fixture(scope="module")
def engine():
    model, config = mega_from_hf(hf_tiny("llama"), "llama")
    return GenerationEngine(model, vocab_size=config.vocab_size, max_positions=POSITIONS)


def cancelling_at(batch: list[GenerationRequest], counts: dict[int, int]):
    """An ``on_token`` that cancels request ``i`` when it has streamed ``counts[i]`` tokens."""
    seen = [0] * len(batch)

    def on_token(index, *_):
        seen[index] += 1
        if seen[index] == counts.get(index):
            batch[index].cancelled = True

    return on_token


def test_generate_cancels_by_the_rule(engine):
    """``mega generate``'s loop (run to completion): a cancellation at the stop token or at the
    last token loses to them; elsewhere it ends the sequence at once."""
    greedy = engine.generate([GenerationRequest([5, 17, 42], 10)])[0].generated
    stop = StopRules(stop_ids=frozenset({greedy[3]}))
    assert greedy[3] not in greedy[:3]
    batch = [GenerationRequest([5, 17, 42], 10, stop=stop),  # cancelled at its stop token
             GenerationRequest([5, 17, 42], 4),  # cancelled at its last token
             GenerationRequest([5, 17, 42], 10)]  # cancelled after 2 tokens
    for static in (False, True):
        for request in batch:
            request.cancelled = False
        results = engine.generate(batch, on_token=cancelling_at(batch, {0: 4, 1: 4, 2: 2}), static_cache=static)
        assert [r.finish_reason for r in results] == ["stop", "length", "cancelled"], static
        assert [r.generated for r in results] == [greedy[:4], greedy[:4], greedy[:2]], static


def test_a_sequence_cancelled_in_the_queue_takes_no_room(engine):
    """The server's worker, one row at a time: the second request, cancelled while the first
    runs, ends ``cancelled`` with nothing computed; a queued request with nothing to generate
    but cancelled ends ``cancelled`` too (nothing computed: only the cancellation applies),
    while a running one at its length ends ``length``."""
    worker = ContinuousBatchingWorker(engine, max_batch_size=1, max_num_tokens=POSITIONS, block_size=16)
    batch = [GenerationRequest([5, 17, 42], 6), GenerationRequest(list(range(20, 40)), 6),
             GenerationRequest([7, 9], 0, logprobs=True)]
    on_token = cancelling_at(batch, {0: 1})

    def cancel_the_queue(index, *rest):
        on_token(index, *rest)
        batch[1].cancelled = batch[2].cancelled = True
        batch[0].cancelled = False  # the running one goes on

    results = worker.run_to_completion(batch, on_token=cancel_the_queue)
    assert [r.finish_reason for r in results] == ["length", "cancelled", "cancelled"]
    assert [len(r.generated) for r in results] == [6, 0, 0]
    assert worker.prefilled_tokens == 3  # the cancelled prompts were never computed
    scored = worker.run_to_completion([GenerationRequest([7, 9], 0, logprobs=True)])[0]
    assert scored.finish_reason == "length" and len(scored.logprobs) == 1


def test_serve_cancels_by_the_rule(engine):
    """The server's worker on its thread: a client leaving (``Job.cancel``) after two tokens ends
    its sequence ``cancelled`` with those tokens; a batch-mate goes on to its length."""
    import asyncio

    from mega.inference.engine.worker import Job

    worker = ContinuousBatchingWorker(engine, max_batch_size=4)
    expected = engine.generate([GenerationRequest([5, 17, 42], 12)])[0].generated

    class LeavingJob(Job):
        def token(self, index, token, logprob, top=None):
            super().token(index, token, logprob, top)
            self.seen = getattr(self, "seen", 0) + 1
            if self.seen == 2:
                self.cancel()

    async def run():
        loop = asyncio.get_running_loop()
        leaving, staying = LeavingJob([GenerationRequest([5, 17, 42], 12)], loop), Job(
            [GenerationRequest([5, 17, 42], 12)], loop)
        worker.submit(leaving)
        worker.submit(staying)
        return (await leaving.done)[0], (await staying.done)[0]

    worker.start()
    try:
        left, stayed = asyncio.run(run())
    finally:
        worker.stop()
    assert left.finish_reason == "cancelled" and left.generated == expected[:2]
    assert stayed.finish_reason == "length" and stayed.generated == expected


@pytest.fixture(scope="module")
def seq2seq():
    """A random tiny T5 (mega's) and its engine."""
    from mega.inference.engine.encoder_decoder import EncoderDecoderEngine

    transformers = pytest.importorskip("transformers")
    from mega.core.build import build_stage
    from mega.models.t5.family import FAMILY
    from mega.models.t5.hf_t5 import t5_config

    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, dropout_rate=0.0)
    torch.manual_seed(0)
    model = build_stage(FAMILY, t5_config(config.to_dict(), seq_length=32, decoder_seq_length=16), training=False)
    return EncoderDecoderEngine(model.eval(), vocab_size=64, max_positions=32)


def test_t5_cancels_by_the_rule(seq2seq):
    """T5's loop: the same queue rule and decode step (a cancellation at the last token loses to
    the length; one queued behind a running batch ends with nothing computed)."""
    from mega.inference.engine.encoder_decoder import EncoderDecoderWorker

    worker = EncoderDecoderWorker(seq2seq, max_batch_size=1)
    batch = [GenerationRequest([5, 6, 7], 4), GenerationRequest([8, 9], 4)]
    seen = [0, 0]

    def on_token(index, *_):
        seen[index] += 1
        batch[1].cancelled = True  # queued behind the running batch
        batch[0].cancelled = seen[0] == 4  # at its last token

    results = worker.run_to_completion(batch, on_token=on_token)
    assert [r.finish_reason for r in results] == ["length", "cancelled"]
    assert [len(r.generated) for r in results] == [4, 0] and seen == [4, 0]
    assert [r.generated for r in results[:1]] == [seq2seq.generate([GenerationRequest([5, 6, 7], 4)])[0].generated]


def test_sampling_params_reach_the_loop_unchanged(engine):
    """A seeded request gives the same tokens alone and beside others (per-sequence streams)."""
    request = GenerationRequest([5, 17, 42], 10, SamplingParams(temperature=0.9, top_k=30, seed=4))
    alone = engine.generate([request])[0].generated
    beside = engine.generate([GenerationRequest([1, 2], 5), request])[1].generated
    assert alone == beside


def test_a_failing_t5_batch_answers_its_requests_and_the_worker_lives_on(seq2seq, monkeypatch):
    """The server's T5 worker: an encode that fails answers the batch's jobs with the error (none
    is left waiting); the next batch runs."""
    import asyncio

    from mega.inference.engine.encoder_decoder import EncoderDecoderWorker
    from mega.inference.engine.worker import Job

    worker = EncoderDecoderWorker(seq2seq, max_batch_size=4)
    expected = seq2seq.generate([GenerationRequest([5, 6, 7], 3)])[0].generated

    def broken(*args):
        raise RuntimeError("the accelerator caught fire")

    async def run(request):
        job = Job([request], asyncio.get_running_loop())
        worker.submit(job)
        return (await asyncio.wait_for(job.done, 60))[0]  # a job left unanswered fails, not hangs

    worker.start()
    try:
        monkeypatch.setattr(seq2seq.model, "encode", broken)
        with pytest.raises(RuntimeError, match="caught fire"):
            asyncio.run(run(GenerationRequest([5, 6, 7], 3)))
        monkeypatch.undo()
        assert asyncio.run(run(GenerationRequest([5, 6, 7], 3))).generated == expected
    finally:
        worker.stop()
