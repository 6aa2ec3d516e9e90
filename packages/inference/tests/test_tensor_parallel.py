"""Tensor-parallel generation (tp=2 on gloo, CPU): the leader hands batches to the follower, and
the results equal one process's, with the one loop run to completion on the paged and the static
KV cache (its decode steps eager here; what CUDA graphs capture on a GPU), continuous batching on
the static KV cache (the serving default on a GPU), and ``mega generate``'s whole ``main`` (the
leader handing the follower each step's admissions); a cancellation on the leader alone keeps the
ranks in step."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import POSITIONS, VOCAB, hf_tiny, mega_from_hf_weights  # noqa: E402

pytest.importorskip("transformers")

FAMILIES = [("gpt2", "gpt"), ("llama", "llama")]


def requests():
    from mega.inference.engine import GenerationRequest
    from mega.inference.engine.sampling import SamplingParams

    return [
        GenerationRequest([5, 17, 42, 8, 99], 10, logprobs=True, top_logprobs=2),
        GenerationRequest([7, 200], 12, SamplingParams(temperature=0.8, top_k=20, seed=11), logprobs=True),
        GenerationRequest([1, 2, 3, 4, 5, 6, 7, 8, 9], 6, SamplingParams(top_p=0.8, seed=3)),
        GenerationRequest([9, 9, 9], 20),  # cancelled by the leader after 3 tokens
    ]


def generate(weights, family_name: str, tp: int, static: bool = False):
    """The leader's results (None on the follower) at tensor-parallel size ``tp``."""
    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.inference.engine import GenerationEngine
    from mega.inference.engine.tp_serving import lead, receive

    groups = ParallelGroups(ParallelConfig(tp=tp))
    model, config = mega_from_hf_weights(*weights, family_name, groups)
    engine = GenerationEngine(model, vocab_size=VOCAB, max_positions=POSITIONS, tp_group=groups.tp)
    def run(batch, on_token=None):  # the one loop, run to completion on every rank alike
        return engine.generate(batch, on_token=on_token, static_cache=static)

    if groups.tp.rank != 0:
        while (batch := receive(groups.tp)) is not None:
            run(batch)
        return None
    batch, counts = requests(), [0] * 4

    def cancel_last(index, token, logprob, top):
        counts[index] += 1
        if index == 3 and counts[index] == 3:
            batch[3].cancelled = True

    lead(batch, groups.tp)
    results = run(batch, on_token=cancel_last)
    lead(None, groups.tp)
    return results


def serve_continuously(weights, family_name: str, tp: int):
    """The leader's results (None on the follower) of ``mega serve``'s continuous batching on the
    static KV cache (with prefix caching, steps eager: the code CUDA graphs capture on a GPU), the
    requests joining one at a time, the leader's client cancelling the last after 3 tokens."""
    import asyncio

    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.inference.cli.engine_setup import build_worker
    from mega.inference.cli.serve import build_parser
    from mega.inference.engine import GenerationEngine
    from mega.inference.engine.continuous import ContinuousBatchingWorker
    from mega.inference.engine.tp_serving import lead
    from mega.inference.engine.worker import Job

    groups = ParallelGroups(ParallelConfig(tp=tp))
    model, config = mega_from_hf_weights(*weights, family_name, groups)
    engine = GenerationEngine(model, vocab_size=VOCAB, max_positions=POSITIONS, tp_group=groups.tp)
    # As `torchrun ... mega serve --static-kv-cache --no-cuda-graphs` builds it on every rank.
    args = build_parser().parse_args(["--load", ".", "--max-batch-size", "4", "--static-kv-cache", "--no-cuda-graphs"])
    if groups.tp.rank != 0:
        build_worker(args, engine).follow()
        return None
    worker = build_worker(args, engine)
    assert isinstance(worker, ContinuousBatchingWorker) and worker.prefix_caching and worker._decode_steps is not None
    batch = requests()

    class CancellingJob(Job):
        def token(self, index, token, logprob, top=None):
            if self.requests[index] is batch[3] and len(self.tokens_seen) == 2:
                batch[3].cancelled = True
            self.tokens_seen.append(token)
            super().token(index, token, logprob, top)

    async def run():
        loop = asyncio.get_running_loop()
        jobs = []
        for request in batch:
            jobs.append(CancellingJob([request], loop))
            jobs[-1].tokens_seen = []
            worker.submit(jobs[-1])
            await asyncio.sleep(0.01)
        return [(await job.done)[0] for job in jobs]

    worker.start()
    try:
        return asyncio.run(run())
    finally:
        worker.stop()
        lead(None, groups.tp)


def generate_all(weights: dict, tp: int):
    results = {kind: generate(weights[kind], family_name, tp) for kind, family_name in FAMILIES}
    if tp > 1:  # tp2 on the static KV cache, LLaMA (grouped-query heads split over the ranks)
        results["llama-static"] = generate(weights["llama"], "llama", tp, static=True)
        results["llama-continuous-static"] = serve_continuously(weights["llama"], "llama", tp)
    return results


def test_tensor_parallel_generation_equals_one_process(worlds):
    models = {kind: hf_tiny(kind) for kind, _ in FAMILIES}
    weights = {kind: (model.config.to_dict(), model.state_dict()) for kind, model in models.items()}
    expected = generate_all(weights, tp=1)
    leader, follower = worlds.run(2, generate_all, weights, 2)
    assert all(results is None for results in follower.values())
    expected["llama-static"] = expected["llama-continuous-static"] = expected["llama"]
    for kind in [*(kind for kind, _ in FAMILIES), "llama-static", "llama-continuous-static"]:
        for got, want in zip(leader[kind], expected[kind], strict=True):
            assert got.tokens == want.tokens, kind
            assert got.finish_reason == want.finish_reason
            if want.logprobs is not None:
                assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < 1e-5
        assert leader[kind][3].finish_reason == "cancelled" and len(leader[kind][3].generated) == 3
        assert [t for t, _ in leader[kind][0].top_logprobs[-1]] == [t for t, _ in expected[kind][0].top_logprobs[-1]]


def generate_command(directory: str, *flags: str) -> str:
    """What ``mega generate``'s whole ``main`` prints on this rank (rank 0 prints; 3 prompts, 2 at
    a time, so the third joins the running batch on both ranks). Seeded sampling, log-probabilities."""
    import contextlib
    import io

    from mega.inference.cli.generate import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["--load", directory, "--device", "cpu", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                     str(VOCAB - 1), "--max-tokens", "6", "--json", "--logprobs", "--temperature", "0.8", "--seed",
                     "3", "--max-batch-size", "2", "--prompt", "5 17 42", "--prompt", "7 9", "--prompt", "1 2 3 4",
                     *flags]) == 0
    return printed.getvalue()


def test_mega_generate_under_tensor_parallelism_equals_one_process(worlds, tmp_path):
    import json

    hf_tiny("llama").save_pretrained(tmp_path)
    expected = [json.loads(line) for line in generate_command(str(tmp_path)).splitlines()]
    leader, follower = worlds.run(2, generate_command, str(tmp_path))
    assert follower == "" and len(expected) == 3
    for got, want in zip((json.loads(line) for line in leader.splitlines()), expected, strict=True):
        assert got["tokens"] == want["tokens"] and got["finish_reason"] == want["finish_reason"]
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)) < 1e-5


def generate_with_adapters(weights, adapters: dict, tp: int, base_only: bool = False):
    """The leader's results (None on the follower) of one batch mixing the base and LoRA adapters
    (PEFT directories, each row its own: mega serve --lora-modules) at tensor-parallel size ``tp``
    (``base_only``: the same prompts, every row the base's)."""
    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.core.plugins import get_plugins
    from mega.inference.engine import GenerationEngine, GenerationRequest
    from mega.inference.engine.lora_registry import AdapterRegistry
    from mega.inference.engine.tp_serving import lead, receive
    from mega.models.lora.adapter_files import read_adapter
    from mega.models.lora.multi import adaptable_weight_shapes, apply_multi_lora

    groups = ParallelGroups(ParallelConfig(tp=tp))
    model, config = mega_from_hf_weights(*weights, "llama", groups)
    family, shapes = get_plugins().models.get("llama"), adaptable_weight_shapes(model)
    registry = AdapterRegistry(apply_multi_lora(model, len(adapters), 24),
                               lambda path: read_adapter(path, family, config, shapes, None, "base"))
    for name, path in adapters.items():  # every rank alike: the same slots
        registry.load(name, path)
    engine = GenerationEngine(model, vocab_size=VOCAB, max_positions=POSITIONS, tp_group=groups.tp)
    engine.lora = registry.lora
    if groups.tp.rank != 0:
        while (batch := receive(groups.tp)) is not None:
            engine.generate(batch)
        return None
    names = [None, *adapters, None, *adapters]
    batch = [GenerationRequest([5 + k, 17, 42, 8][: 2 + k % 3], 8,
                               adapter=None if base_only or name is None else registry.acquire(name))
             for k, name in enumerate(names)]
    lead(batch, groups.tp)
    results = engine.generate(batch)
    lead(None, groups.tp)
    return [r.tokens for r in results]


def test_served_lora_adapters_under_tensor_parallelism_equal_one_process(worlds, tmp_path):
    """Column-parallel layers' B split by rows (SwiGLU's two blocks each), row-parallel layers' A
    by columns with the low-rank products summed: tp2 gives one process's tokens."""
    import peft
    import torch

    model = hf_tiny("llama")
    weights = (model.config.to_dict(), model.state_dict())
    adapters = {}
    for number, targets in enumerate([["q_proj", "v_proj", "o_proj", "up_proj"], ["k_proj", "gate_proj", "down_proj"]]):
        torch.manual_seed(number)
        made = peft.get_peft_model(hf_tiny("llama"), peft.LoraConfig(r=4 + 4 * number, lora_alpha=8,
                                                                     target_modules=targets, init_lora_weights=False))
        with torch.no_grad():
            for name, parameter in made.named_parameters():
                if "lora_B" in name:
                    parameter.mul_(4.0)
        made.save_pretrained(tmp_path / f"adapter{number}")
        adapters[f"adapter{number}"] = str(tmp_path / f"adapter{number}")
    expected = generate_with_adapters(weights, adapters, 1)
    base = generate_with_adapters(weights, adapters, 1, base_only=True)
    assert expected[0] == base[0] and expected[1] != base[1] and expected[2] != base[2]  # the adapters change them
    leader, follower = worlds.run(2, generate_with_adapters, weights, adapters, 2)
    assert follower is None and leader == expected


def test_int8_quantized_generation_under_tensor_parallelism_equals_one_process(worlds, tmp_path):
    """``--quantization int8`` (mega-torchao) at tp2: each rank quantizes its shards, the
    row-parallel ones with their rows' whole scales, so tp2 gives tp1's tokens and log-probabilities
    within 1e-5 (the sums' order only)."""
    import json

    pytest.importorskip("mega_torchao")
    hf_tiny("llama").save_pretrained(tmp_path)
    expected = [json.loads(line) for line in generate_command(str(tmp_path), "--quantization", "int8").splitlines()]
    leader, follower = worlds.run(2, generate_command, str(tmp_path), "--quantization", "int8")
    assert follower == "" and len(expected) == 3
    for got, want in zip((json.loads(line) for line in leader.splitlines()), expected, strict=True):
        assert got["tokens"] == want["tokens"] and got["finish_reason"] == want["finish_reason"]
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)) < 1e-5
