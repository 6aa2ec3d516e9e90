"""The one loop on the static KV cache (fixed shapes per batch-size bucket, what CUDA graphs
capture; run eagerly on CPU here) gives the paged cache's tokens, greedy and sampled, for
prompts of different lengths. The CUDA-graph capture itself needs a GPU and is not run here."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import POSITIONS  # noqa: E402

from mega.inference.engine import GenerationEngine, GenerationRequest  # noqa: E402
from mega.inference.engine.continuous import ContinuousBatchingWorker  # noqa: E402
from mega.inference.engine.sampling import SamplingParams  # noqa: E402
from mega.inference.engine.slot_kv_cache import bucket_for  # noqa: E402
from mega.inference.engine.stopping import StopRules  # noqa: E402


def static_worker(engine: GenerationEngine, slots: int) -> ContinuousBatchingWorker:
    """The decoder loop on the static KV cache, a slot per request (``mega generate --static-kv-cache``)."""
    return ContinuousBatchingWorker(engine, max_batch_size=slots, max_num_tokens=slots * POSITIONS, static_cache=True)


def test_static_cache_decoding_equals_the_engine(tiny_pair):
    _, model, config = tiny_pair
    engine = GenerationEngine(model, vocab_size=config.vocab_size, max_positions=POSITIONS)
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=5, presence_penalty=0.3)
    requests = [GenerationRequest([5, 17, 42, 8, 99], 12), GenerationRequest([7], 20, sampling=sampled),
                GenerationRequest(list(range(30, 48)), 9, stop=StopRules(stop_ids=frozenset({1, 2, 3}))),
                GenerationRequest([11, 12], 0)]
    expected = [engine.generate([request])[0] for request in requests]
    decoder = static_worker(engine, len(requests))
    assert decoder._decode_steps.use_cuda_graphs is False  # off on CPU
    got = decoder.run_to_completion(requests)
    assert [r.tokens for r in got] == [r.tokens for r in expected]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in expected]
    assert bucket_for(3) == 4 and bucket_for(64) == 64


def test_static_kv_cache_is_on_by_default_on_cuda_only(tmp_path):
    import pytest
    import torch

    from mega.inference.cli.generate import build_parser
    from mega.inference.engine import GenerationError
    from mega.inference.engine.slot_kv_cache import static_kv_cache_wanted

    def wanted(flags: list[str], device: str, tp: int = 1) -> bool:
        args = build_parser().parse_args(["--load", str(tmp_path), *flags])
        return static_kv_cache_wanted(args.static_kv_cache, torch.device(device), not args.logprobs and tp == 1,
                                      "without --logprobs")

    assert wanted([], "cuda") and not wanted([], "cpu")
    assert not wanted(["--no-static-kv-cache"], "cuda") and wanted(["--static-kv-cache"], "cpu")
    assert not wanted(["--logprobs"], "cuda") and not wanted([], "cuda", tp=2)  # where it cannot run: off
    with pytest.raises(GenerationError, match="--static-kv-cache"):
        wanted(["--static-kv-cache", "--logprobs"], "cpu")
    assert build_parser().parse_args(["--load", str(tmp_path), "--no-cuda-graphs"]).cuda_graphs is False


def test_serve_runs_the_static_kv_cache_by_default_on_cuda_under_continuous_batching(tmp_path):
    import pytest
    import torch

    from mega.inference.cli.engine_setup import static_kv_cache
    from mega.inference.cli.serve import build_parser
    from mega.inference.engine import GenerationError

    def static(flags: list[str], device: str) -> bool:
        return static_kv_cache(build_parser().parse_args(["--load", str(tmp_path), *flags]), torch.device(device))

    assert static([], "cuda") and not static([], "cpu") and static(["--static-kv-cache"], "cpu")
    assert not static(["--max-num-tokens", "4096"], "cuda")  # a paged cache of that size, unless asked
    assert static(["--max-num-tokens", "4096", "--static-kv-cache"], "cuda")
    with pytest.raises(GenerationError, match="--static-kv-cache runs for decoder-only models"):
        static_kv_cache(build_parser().parse_args(["--load", str(tmp_path), "--static-kv-cache"]),
                        torch.device("cpu"), decoder_only=False)


def test_greedy_batches_choose_their_tokens_inside_the_step(tiny_pair, monkeypatch):
    """CPU. An all-greedy batch takes its tokens from the step's own argmax (what the captured graph
    computes on CUDA) once every row is past its prompt: the same tokens and endings as the engine,
    with rows retiring out of order (a stop in the first row, lengths in the others)."""
    from mega.inference.engine.slot_kv_cache import DecodeGraphs

    _, model, config = tiny_pair
    engine = GenerationEngine(model, vocab_size=config.vocab_size, max_positions=POSITIONS)
    first = engine.generate([GenerationRequest([3, 9, 27], 8)])[0].tokens[3:]
    requests = [GenerationRequest([3, 9, 27], 8, stop=StopRules(stop_ids=frozenset({first[2]}))),
                GenerationRequest([5, 17, 42, 8, 99], 11), GenerationRequest(list(range(30, 48)), 6),
                GenerationRequest([7, 1], 14)]
    expected = [engine.generate([request])[0] for request in requests]
    greedy_steps = []
    original = DecodeGraphs.greedy
    monkeypatch.setattr(DecodeGraphs, "greedy", lambda self, *a: greedy_steps.append(1) or original(self, *a))
    got = static_worker(engine, len(requests)).run_to_completion(requests)
    assert [r.tokens for r in got] == [r.tokens for r in expected]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in expected]
    assert len(greedy_steps) == 13  # every step after the first (which reads the prefill's logits)


def test_log_probabilities_keep_the_logits_path(tiny_pair):
    """CPU. A row asking for log-probabilities needs the step's logits: no choice on the device."""
    _, model, config = tiny_pair
    engine = GenerationEngine(model, vocab_size=config.vocab_size, max_positions=POSITIONS)
    requests = [GenerationRequest([5, 17, 42], 6, logprobs=True), GenerationRequest([7], 6)]
    expected = [engine.generate([request])[0] for request in requests]
    got = static_worker(engine, len(requests)).run_to_completion(requests)
    assert [r.tokens for r in got] == [r.tokens for r in expected]
    for mine, theirs in zip(got[0].logprobs, expected[0].logprobs, strict=True):
        assert abs(mine - theirs) < 1e-5
