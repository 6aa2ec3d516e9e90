"""Speculative decoding with drafts from the model's own multi-token-prediction layer
(``--speculative-method mtp``, issue 52 item 1(c)). Runs on CPU, fp32 (pinned: ``--device cpu``
and models built on the CPU).

The models: a tiny DeepSeek-V3 (64-token vocabulary) with ``--mtp-num-layers 2`` trained 30 steps
on a repeating 12-token cycle, so its MTP layers predict the continuation, and the same with its
first MTP layer only (``--mtp-num-layers 1``, as DeepSeek-V3 itself): every greedy draft accepted.
Copies whose MTP layers have noise added (std 0.2) draft worse (about two in three accepted), so
proposals both catch up on several accepted tokens and roll rejected ones back.

- Every proposal's drafts equal those of the MTP layer run without a cache over the sequence as it
  stands (the target's hidden states, then the layer's own output recursively): the catch-up, the
  rollback and the recursion compute what the definition says.
- Greedy: ``mega generate`` (batch 1 and a mixed batch of 8, paged and static cache) and ``mega
  serve`` give the tokens they give without speculation; ``/metrics`` counts the drafts.
- Sampling keeps the target's distribution (chi-square over (first, second) token pairs).
- A model without MTP layers is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from in_process_server import serving  # noqa: E402
from test_speculative import pair_chi_square_p  # noqa: E402

from mega.core.build import build_stage  # noqa: E402
from mega.core.model_family import LossContext  # noqa: E402
from mega.inference.engine import GenerationEngine, GenerationRequest  # noqa: E402
from mega.inference.engine.continuous import ContinuousBatchingWorker  # noqa: E402
from mega.inference.engine.mtp_proposer import MTPProposer  # noqa: E402
from mega.inference.engine.sampling import SamplingParams  # noqa: E402
from mega.inference.engine.speculative import Speculator  # noqa: E402
from mega.models.deepseek_v3.family import FAMILY, PRESETS  # noqa: E402

VOCAB, POSITIONS = 64, 64
CONFIG = dataclasses.replace(PRESETS["tiny"], vocab_size=VOCAB, seq_length=32, mtp_num_layers=2,
                             max_position_embeddings=POSITIONS, mtp_loss_scaling_factor=1.0)
TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)]
NEW_TOKENS = 12


def cycle_stream() -> list[int]:
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:12].repeat(8).tolist()


def batch_prompts() -> list[list[int]]:
    """Eight prompts of different lengths: six from the cycle, two random."""
    stream = cycle_stream()
    prompts = [stream[start: start + length] for start, length in [(0, 10), (3, 2), (5, 11), (1, 4), (7, 6), (2, 1)]]
    random = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    return [*prompts, random, random[:3]]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = build_stage(FAMILY, CONFIG, seed=5)
    stream = torch.tensor(cycle_stream())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):
        starts = torch.randint(0, 12, (4,))
        tokens = torch.stack([stream[s: s + 33] for s in starts])
        outputs = model({"tokens": tokens[:, :-1]})
        loss, _ = FAMILY.loss(outputs, {"labels": tokens[:, 1:], "loss_mask": torch.ones(4, 32)},
                              LossContext(config=CONFIG, kernels=model.kernels))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def variant(model, mtp_layers: int, noise: float):
    """``model`` with its first ``mtp_layers`` MTP layers, their weights perturbed by ``noise``."""
    config = dataclasses.replace(CONFIG, mtp_num_layers=mtp_layers)
    copy = build_stage(FAMILY, config, seed=5, training=False).eval()
    copy.load_state_dict({name: tensor for name, tensor in model.state_dict().items()
                          if not name.startswith("mtp.layers.") or int(name.split(".")[2]) < mtp_layers})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in copy.mtp.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * noise)
    return copy


@pytest.fixture(scope="module")
def noisy(model):
    """One MTP layer (as DeepSeek-V3), perturbed."""
    return variant(model, 1, 0.2)


def engine_of(model) -> GenerationEngine:
    return GenerationEngine(model, vocab_size=VOCAB, max_positions=POSITIONS)


@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory):
    """The trained model with its first MTP layer (as DeepSeek-V3), as a mega checkpoint."""
    from mega.core.checkpoint import CheckpointMetadata, write_checkpoint

    directory = tmp_path_factory.mktemp("deepseek-mtp")
    config = dataclasses.replace(CONFIG, mtp_num_layers=1)
    write_checkpoint(directory, CheckpointMetadata(0, "deepseek-v3", dataclasses.asdict(config)),
                     variant(model, 1, 0.0).state_dict())
    return directory


class RecordingProposer(MTPProposer):
    """Keeps each proposal's sequence tokens and greedy drafts."""

    def __init__(self, *args):
        super().__init__(*args)
        self.proposals: list[tuple[list[int], list[int]]] = []

    def propose(self, sequences, count, sampler):
        drafts, q = super().propose(sequences, count, sampler)
        self.proposals += [(list(s.tokens), d) for s, d in zip(sequences, drafts, strict=True)]
        return drafts, q


def reference_drafts(model, tokens: list[int], count: int) -> list[int]:
    """The MTP layers without a cache, as trained: layer k over the previous layer's outputs (the
    target's hidden states for layer 0) at positions 0..n-2 and the tokens k + 1 positions on,
    the drafts continuing the tokens; then the last layer recursively, one position on, its last
    output appended to its input hidden states."""
    layers, n = list(model.mtp.layers), len(tokens)

    def run(layer, number: int, given: torch.Tensor, extended: list[int]) -> torch.Tensor:
        positions = torch.arange(len(given))[None]
        following = torch.tensor([extended[number + 1: number + 1 + len(given)]])
        return layer(given, model.embedding(following, positions), positions)

    def draft(output: torch.Tensor) -> int:
        return int(model.output_layer(output[-1])[:, :VOCAB].argmax())

    with torch.inference_mode():
        hidden = model.decoder(model.embedding(torch.tensor([tokens[:-1]])), None)  # [n-1, 1, h], final norm
        extended, given = list(tokens), hidden
        for number, layer in enumerate(layers[:count]):
            given = hidden
            hidden = run(layer, number, given, extended)
            extended.append(draft(hidden))
        while len(extended) - n < count:
            given = torch.cat([given, hidden[-1:]])
            hidden = run(layers[-1], len(layers) - 1, given, extended)
            extended.append(draft(hidden))
    return extended[n:]


@pytest.mark.parametrize("mtp_layers", [1, 2])
def test_drafts_follow_the_mtp_layers_definition(model, mtp_layers):
    """The mixed batch of 8, K = 3 (one layer: twice recursively; two layers: the chain, then the
    second once recursively), noisy MTP layers: every proposal equals the reference (accepted
    drafts caught up on, rejected ones rolled back), and the loop's tokens equal decoding without
    speculation. (The trained layer's greedy drafts are all accepted: the commands' test.)"""
    model = variant(model, mtp_layers, 0.2)
    engine = engine_of(model)
    proposer = RecordingProposer(engine, 8, 8 * POSITIONS, 16)
    worker = ContinuousBatchingWorker(engine, max_batch_size=8, speculator=Speculator(proposer, 3))
    requests = [GenerationRequest(p, NEW_TOKENS) for p in batch_prompts()]
    results = worker.run_to_completion(requests)
    assert [r.generated for r in results] == [r.generated for r in engine.generate(requests)]
    assert len(proposer.proposals) >= 8
    for tokens, drafts in proposer.proposals:
        assert drafts == reference_drafts(model, tokens, len(drafts)), tokens
    assert 0.3 < worker.metrics.acceptance_rate < 1, worker.metrics.acceptance_rate


def generate(checkpoint, prompts: list[list[int]], flags: list[str], capsys) -> list[list[int]]:
    from mega.inference.cli.generate import main as generate_main

    argv = ["--load", str(checkpoint), "--device", "cpu", *TOKENIZER, "--max-tokens", str(NEW_TOKENS), "--json",
            "--greedy", *flags, *(arg for p in prompts for arg in ("--prompt", " ".join(map(str, p))))]
    assert generate_main(argv) == 0
    return [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()]


def test_greedy_tokens_equal_without_speculation(checkpoint, capsys):
    """``mega generate``: batch 1 and the mixed batch of 8, paged and static cache; ``mega serve``
    (``PUT /api``): the batch of 8, with the drafts in ``/metrics``: the trained layer's are all
    accepted (K + 1 = 4 tokens a step but at the sequences' ends)."""
    prompts = batch_prompts()
    flags = ["--num-speculative-tokens", "3", "--speculative-method", "mtp"]
    plain = generate(checkpoint, prompts, [], capsys)
    for cache in ([], ["--static-kv-cache"]):
        assert generate(checkpoint, prompts, flags + cache, capsys) == plain, cache
        assert generate(checkpoint, prompts[:1], flags + cache, capsys) == plain[:1], cache
    body = {"prompts": [" ".join(map(str, p)) for p in prompts], "tokens_to_generate": NEW_TOKENS, "top_k": 1}
    with serving(["--load", str(checkpoint), "--device", "cpu", *TOKENIZER, *flags]) as send:
        answer, metrics = send("PUT", "/api", body), send("GET", "/metrics")
    assert answer.status_code == 200, answer.text
    for prompt, tokens, mine in zip(prompts, answer.json()["tokens"], plain, strict=True):
        assert tokens[len(prompt):] == mine, prompt
    values = dict(line.rsplit(" ", 1) for line in metrics.text.splitlines() if line.startswith("mega_spec_decode"))
    assert float(values["mega_spec_decode_draft_tokens_total"]) > 0
    assert float(values["mega_spec_decode_acceptance_rate"]) == 1.0
    assert float(values["mega_spec_decode_tokens_per_step"]) > 3


def test_sampled_tokens_follow_the_target(noisy):
    """800 sampled continuations (temperature 4, top-k 3) of two tokens, the second from a
    speculative step: the (first, second) pairs against the target's own probabilities give
    chi-square p > 0.001 (seeded; measured p = 0.19)."""
    sampling = SamplingParams(temperature=4.0, top_k=3)
    prompt, engine = batch_prompts()[0], engine_of(noisy)
    worker = ContinuousBatchingWorker(engine, max_batch_size=64,
                                      speculator=Speculator(MTPProposer(engine, 64, 64 * POSITIONS, 16), 2))
    requests = [GenerationRequest(prompt, 2, SamplingParams(sampling.temperature, sampling.top_k, 0.0, seed))
                for seed in range(800)]
    results = worker.run_to_completion(requests)
    assert worker.metrics.draft_tokens > 0
    p = pair_chi_square_p(results, lambda tokens: model_logits(noisy, tokens), prompt, sampling)
    print(f"chi-square p = {p:.3f}")
    assert p > 0.001


def model_logits(model, tokens: list[int]) -> torch.Tensor:
    """The model's fp32 logits after ``tokens`` (no cache)."""
    return model(torch.tensor([tokens]))[-1, 0, :VOCAB].float()


def test_a_model_without_mtp_layers_is_refused(checkpoint, tmp_path):
    """By name; so is prefix caching asked for with MTP drafts (a cached prefix has no hidden states)."""
    from mega.core.checkpoint import CheckpointMetadata, write_checkpoint
    from mega.inference.cli.generate import main as generate_main
    from mega.inference.cli.serve import main as serve_main

    config = dataclasses.replace(CONFIG, mtp_num_layers=None)
    write_checkpoint(tmp_path, CheckpointMetadata(0, "deepseek-v3", dataclasses.asdict(config)),
                     build_stage(FAMILY, config, seed=1, training=False).state_dict())
    flags = ["--device", "cpu", *TOKENIZER, "--num-speculative-tokens", "2", "--speculative-method", "mtp"]
    with pytest.raises(SystemExit, match="multi-token-prediction layers, and this DeepSeekModel has none"):
        generate_main(["--load", str(tmp_path), *flags, "--prompt", "1 2"])
    with pytest.raises(SystemExit, match="drop --enable-prefix-caching"):
        serve_main(["--load", str(checkpoint), *flags, "--enable-prefix-caching"])
