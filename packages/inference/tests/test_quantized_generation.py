"""``mega generate`` and ``mega serve`` with ``--quantization`` (mega-torchao's pass), on the CPU
(``--device cpu``): a Hugging Face directory and a mega checkpoint
of one tiny LLaMA give the greedy tokens of torchao's own ``quantize_`` over the same model, on
the paged and the static KV cache (whose decode step is what CUDA graphs capture on a GPU: here
it runs eagerly over the quantized weights); the server answers with them. tp2 equals tp1 in
test_tensor_parallel.py (its world)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from in_process_server import serving  # noqa: E402
from tiny_models import POSITIONS, VOCAB, hf_tiny, mega_from_hf  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("mega_torchao")
import torch  # noqa: E402

PROMPTS = ["5 17 42", "7 9 200 13"]
NEW_TOKENS = 24
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(Hugging Face directory, mega checkpoint, transformers model) of one tiny LLaMA."""
    from mega.core.checkpoint import CheckpointMetadata, write_checkpoint
    from mega.core.plugins import get_plugins
    from mega.core.tokenizer import TokenizerOptions, TokenizerSpec
    from mega.models.hf_mapping import hf_to_mega

    hf_model = hf_tiny("llama")
    hf_dir = tmp_path_factory.mktemp("hf")
    hf_model.save_pretrained(hf_dir)
    family = get_plugins().models.get("llama")
    config = family.hf_mapping.config_from_hf(hf_model.config.to_dict())
    mega_dir = tmp_path_factory.mktemp("mega")
    write_checkpoint(mega_dir, CheckpointMetadata(iteration=0, model_family="llama",
                                                  model_config=dataclasses.asdict(config)),
                     hf_to_mega(family.hf_mapping, hf_model.state_dict(), config),
                     tokenizer=TokenizerSpec("NullTokenizer", TokenizerOptions(vocab_size=VOCAB - 1)))
    return str(hf_dir), str(mega_dir), hf_model


def generate(argv: list[str]) -> tuple[list[dict], str]:
    """``mega generate``'s JSON lines and what it printed on stderr (rank 0's; '' on a follower)."""
    from mega.inference.cli.generate import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["--device", "cpu", "--max-tokens", str(NEW_TOKENS), "--greedy", "--json", "--logprobs",
                     *argv, *(arg for prompt in PROMPTS for arg in ("--prompt", prompt))]) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue()


def torchao_reference(hf_model) -> list[list[int]]:
    """Greedy tokens of the engine over the same model quantized by torchao's quantize_ itself."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from mega.inference.engine import GenerationEngine, GenerationRequest

    model, config = mega_from_hf(hf_model, "llama")
    model = copy.deepcopy(model)
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda layer, name: isinstance(layer, torch.nn.Linear)
              and name != "output_layer")
    engine = GenerationEngine(model, vocab_size=VOCAB, max_positions=POSITIONS)
    results = engine.generate([GenerationRequest([int(t) for t in prompt.split()], NEW_TOKENS) for prompt in PROMPTS])
    return [result.generated for result in results]


# Against the float model (measured): the first prompt's 24 tokens equal, the second's first 2
# (then a near tie falls the other way: a random model's margins are small); log-probabilities of
# the common tokens within 0.02.
LEADING_EQUAL = (NEW_TOKENS, 2)


@pytest.mark.parametrize("which", ["hugging-face", "mega", "static-kv-cache"])
def test_generate_int8_gives_torchaos_tokens(checkpoints, which):
    """CPU. ``--quantization int8`` on either checkpoint kind (and on the static KV cache) gives
    the tokens of torchao's quantize_ over the same model, close to the float model's (LEADING_EQUAL), and
    prints the weight bytes before and after."""
    hf_dir, mega_dir, hf_model = checkpoints
    load = ["--load", mega_dir] if which == "mega" else ["--load", hf_dir, *NULL_TOKENIZER]
    static = ["--static-kv-cache"] if which == "static-kv-cache" else []
    records, printed = generate([*load, *static, "--quantization", "int8"])
    assert [record["tokens"] for record in records] == torchao_reference(hf_model)
    assert "mega generate: --quantization int8: weights 0.36 MiB -> 0.19 MiB (0.52x) on this rank" in printed
    float_records, _ = generate(load)
    for got, want, least in zip(records, float_records, LEADING_EQUAL, strict=True):
        leading = next((i for i, (a, b) in enumerate(zip(got["tokens"], want["tokens"], strict=True)) if a != b), NEW_TOKENS)
        gap = max(abs(a - b) for a, b in list(zip(got["logprobs"], want["logprobs"], strict=True))[:leading + 1])
        assert leading >= least and 0 < gap < 0.05, (leading, gap)


def test_serve_int8_answers_with_the_quantized_tokens(checkpoints):
    """CPU. ``mega serve --quantization int8`` answers /v1/completions with ``mega generate``'s tokens."""
    hf_dir, _, _ = checkpoints
    records, _ = generate(["--load", hf_dir, *NULL_TOKENIZER, "--quantization", "int8"])
    with serving(["--load", hf_dir, *NULL_TOKENIZER, "--device", "cpu", "--quantization", "int8"]) as send:
        answer = send("POST", "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == records[0]["text"]


def test_refusals_end_the_command_naming_the_kind(checkpoints, capsys):
    """CPU. An unknown kind ends ``mega generate`` before the weights load, with the plugin's reason."""
    from mega.inference.cli.generate import main

    hf_dir, _, _ = checkpoints
    with pytest.raises(SystemExit, match=r"mega generate: error: --quantization int3: unknown kind 'int3': "
                                         r"mega-torchao quantizes weights as int8, fp8, int4"):
        main(["--load", hf_dir, *NULL_TOKENIZER, "--device", "cpu", "--prompt", "1", "--quantization", "int3"])
