"""The ``gpt-oss`` family against transformers' ``GptOssForCausalLM`` with every feature on
(attention sinks, sliding-window layers alternating with full ones under a window shorter than the
sequence, YaRN rotary, clamped SwiGLU experts with biases, a biased router; 4 experts, top-2,
GQA). CPU, fp32, one process (gloo worlds where said).

Hugging Face -> mega -> Hugging Face is bit-exact; the logits and loss equal transformers' (1e-5);
a checkpoint whose experts are stored as MXFP4 blocks and scales (transformers' layout) converts
to the logits of the dequantized model; greedy generation over 32 tokens equals transformers'
``generate`` through ``mega generate``, ``mega serve`` (prompts of several lengths at once) and the
serving engine's paged and static caches (requests joining a running batch)."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_test_models import (  # noqa: E402
    TEXT_PROMPTS,
    VOCAB,
    generation_engine,
    input_ids,
    mega_generate_records,
    save_hf_model,
)

transformers = pytest.importorskip("transformers")

from mega.ckpt_convert import convert  # noqa: E402

WINDOW = 4  # shorter than the tests' sequences (16 tokens, prompts of 2-9 and 32 new tokens)
PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [11, 12, 13, 14, 15, 16, 17, 18, 19], [7, 250]]
NEW_TOKENS = 32

pytestmark = pytest.mark.usefixtures("cpu_only")


@pytest.fixture
def cpu_only(monkeypatch):
    """In-process runs on the CPU (as transformers' reference) on a GPU machine too."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def make_gpt_oss(seed: int = 16):
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=128, initializer_range=0.1, swiglu_limit=0.5,  # low: the clamp acts
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 32, "rope_theta": 150000.0})
    assert config.layer_types == ["sliding_attention", "full_attention"]
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1, biases and sinks at 0: make every value count
        for name, param in model.named_parameters():
            if param.dim() == 1 or name.endswith("_bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.fixture(scope="module")
def hf_model():
    return make_gpt_oss()


@pytest.fixture(scope="module")
def converted(hf_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    hf_dir = save_hf_model(hf_model, root / "hf")
    mega_dir = root / "mega"
    convert(hf_dir, mega_dir, to_format="mega")
    return hf_dir, mega_dir


def hf_logits(model, ids):
    with torch.no_grad():
        out = model(ids, labels=ids)
    return out.logits, out.loss


def test_one_process_logits_equal_transformers(hf_model, converted, assert_close):
    from test_layout_logits import stage_logits

    from mega.core.parallel import ParallelConfig, ParallelGroups

    ids = input_ids()
    logits, loss = stage_logits(str(converted[1]), ids, ParallelGroups(ParallelConfig()))
    expected, expected_loss = hf_logits(hf_model, ids)
    assert_close(logits, expected, what="gpt-oss")
    assert_close(loss, expected_loss, what="gpt-oss loss")


def test_mega_to_hugging_face_is_bit_exact(converted, tmp_path):
    from safetensors.torch import load_file

    hf_dir, mega_dir = converted
    convert(mega_dir, tmp_path / "back", to_format="hf")
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)
    assert type(reloaded).__name__ == "GptOssForCausalLM"
    for key in ("layer_types", "sliding_window", "rope_parameters", "swiglu_limit", "swiglu_alpha"):
        assert getattr(reloaded.config, key) == getattr(transformers.AutoConfig.from_pretrained(hf_dir), key), key


def quantize_experts_as_mxfp4(hf_model, directory):
    """Rewrite ``directory`` (the saved ``hf_model``) with its experts as random MXFP4 blocks and
    scales in transformers' layout ([experts, out, in / 32, 16] and [experts, out, in / 32], uint8)
    and config.json's quantization_config; returns transformers' dequantized experts by name."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(3)
    tensors, dequantized = load_file(directory / "model.safetensors"), {}
    for name in [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, columns, rows = tensors.pop(name).shape  # [experts, in, out]
        blocks = torch.randint(0, 256, (experts, rows, columns // 32, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(121, 126, (experts, rows, columns // 32), dtype=torch.uint8, generator=generator)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
    return dequantized


def test_our_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from mega.ckpt_convert.mxfp4 import dequantize_mxfp4

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 2, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(100, 140, (3, 5, 2), dtype=torch.uint8, generator=generator)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize_mxfp4(blocks, scales, dtype)  # [3, 5, 64]
        assert torch.equal(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=dtype)), dtype


def test_an_mxfp4_checkpoint_converts_to_the_logits_of_the_dequantized_model(tmp_path, assert_close, capsys):
    from test_layout_logits import stage_logits

    from mega.ckpt_convert.cli import main
    from mega.core.parallel import ParallelConfig, ParallelGroups

    model = make_gpt_oss()
    hf_dir = save_hf_model(model, tmp_path / "mxfp4")
    dequantized = quantize_experts_as_mxfp4(model, hf_dir)
    model.load_state_dict(dequantized, strict=False)  # transformers' model with the dequantized experts
    assert main(["--from", "hf", "--to", "mega", "--input", str(hf_dir), "--output", str(tmp_path / "mega")]) == 0
    assert "were dequantized to float32 on import" in capsys.readouterr().err
    ids = input_ids()
    logits, loss = stage_logits(str(tmp_path / "mega"), ids, ParallelGroups(ParallelConfig()))
    expected, expected_loss = hf_logits(model, ids)
    assert_close(logits, expected, what="gpt-oss from MXFP4")
    assert_close(loss, expected_loss, what="gpt-oss from MXFP4 loss")
    # Back to Hugging Face: the experts unquantized, as transformers dequantized them.
    from safetensors.torch import load_file

    assert main(["--from", "mega", "--to", "hf", "--input", str(tmp_path / "mega"),
                 "--output", str(tmp_path / "back")]) == 0
    back = load_file(tmp_path / "back" / "model.safetensors")
    for name, tensor in dequantized.items():
        assert torch.equal(back[name], tensor), name


def hf_greedy(model, prompt, eos=None):
    return model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                          pad_token_id=0 if eos is None else eos)[0].tolist()


@pytest.mark.parametrize("static", [False, True], ids=["paged", "static"])
def test_serving_engine_joins_sequences_and_decodes_as_transformers(hf_model, converted, static):
    """``mega serve``'s engine path: requests join a running batch one after the other (the paged
    cache, or the static one of a slot per sequence)."""
    from test_hf_bridge import staggered

    from mega.inference.engine import GenerationRequest
    from mega.inference.engine.continuous import ContinuousBatchingWorker

    worker = ContinuousBatchingWorker(generation_engine(converted[1]), max_batch_size=3,
                                      max_num_tokens=3 * 128 if static else 96, block_size=8, static_cache=static)
    worker.start()
    try:
        results = asyncio.run(staggered(worker, [GenerationRequest(prompt, NEW_TOKENS) for prompt in PROMPTS]))
    finally:
        worker.stop()
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.tokens[-NEW_TOKENS:] == hf_greedy(hf_model, prompt)[len(prompt):], prompt
    if static:  # the sliding layer (0) keeps a ring of its window per slot (and a scratch row), the full one all
        pools = {number: layer.keys.shape for number, layer in worker.kv.cache._layers.items()}
        assert pools[0][:2] == (3, WINDOW + 1) and pools[1][:2] == (3, 128), pools


def test_mega_generate_prints_transformers_greedy_text(hf_model, converted, capsys):
    """``mega generate`` on the converted checkpoint, prompts of several lengths in one run."""
    hf_dir, mega_dir = converted
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    records = mega_generate_records(mega_dir, TEXT_PROMPTS, NEW_TOKENS, capsys)
    for record in records:
        ids = tokenizer.encode(record["prompt"])
        expected = hf_greedy(hf_model, ids, eos=tokenizer.eos_token_id)[len(ids):]
        assert record["tokens"] == expected, record["prompt"]


def test_mega_serve_answers_transformers_greedy_tokens(hf_model, converted):
    """``mega serve``'s whole ``main`` on the converted checkpoint (its app taken from uvicorn.run,
    requests sent in this process): one ``PUT /api`` of prompts of several lengths, ids as text."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "inference", "tests"))
    from in_process_server import serving

    eod = VOCAB - 1  # NullTokenizer's end of document: it stops both sides
    argv = ["--load", str(converted[1]), "--device", "cpu", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(eod)]
    with serving(argv) as send:
        reply = send("PUT", "/api", {"prompts": [" ".join(map(str, prompt)) for prompt in PROMPTS],
                                     "tokens_to_generate": NEW_TOKENS, "top_k": 1})
    assert reply.status_code == 200, reply.text
    for prompt, tokens in zip(PROMPTS, reply.json()["tokens"], strict=True):
        assert tokens == hf_greedy(hf_model, prompt, eos=eod), prompt

def test_training_at_tp2_with_sequence_parallelism_and_at_ep2_equals_one_process(converted, worlds, tmp_path):
    """The converted model (every feature on; a window shorter than the 16-token samples) trains
    from its weights as one process does (fp32, 1e-5 each of 3 steps) at tp2 with sequence
    parallelism (the experts split over the tensor group, or whole on each rank's slice:
    --expert-tensor-parallel-size 1) and at ep2 (dp2), all on one world of 2 gloo ranks."""
    from mega.train.testing.training_runs import assert_losses_close, train_each, train_losses

    argv = ["--mock-data", "--load", str(converted[1]), "--finetune", "--seq-length", "16", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3", "--lr-warmup-iters", "1",
            "--eval-iters", "0", "--log-interval", "100", "--seed", "7", "--moe-token-dispatcher-type", "alltoall"]
    reference = train_losses(argv)
    assert reference[-1] < reference[0], "the model should learn the mock data"
    tp2_sp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layouts = {"tp2 + sp": tp2_sp, "tp2 + sp, experts whole": tp2_sp + ["--expert-tensor-parallel-size", "1"],
               "ep2": ["--expert-model-parallel-size", "2"]}
    results = worlds.run(2, train_each, [argv + layout for layout in layouts.values()])
    for rank_results in results:
        for name, losses in zip(layouts, rank_results, strict=True):
            assert_losses_close(losses, reference, name)


@pytest.mark.parametrize("settings, field", [
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": 1.0,
                           "original_max_position_embeddings": 32}), "mscale"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}), "rope_type"),
])
def test_what_mega_cannot_express_is_refused_by_field(hf_model, settings, field):
    from mega.models.gpt_oss.hf_gpt_oss import gpt_oss_config

    config = {**hf_model.config.to_dict(), **settings}
    with pytest.raises(ValueError, match=field):
        gpt_oss_config(config)


def test_split_experts_are_refused_and_the_architecture_is_listed(capsys):
    from mega.ckpt_convert.cli import main
    from mega.core.build import build_stage
    from mega.core.parallel import ParallelConfig
    from mega.models.config import ModelConfigError
    from mega.models.gpt_oss.family import FAMILY, PRESETS

    with pytest.raises(ModelConfigError, match="--expert-tensor-parallel-size 2 must be 1 or the tensor-parallel size 4"):
        build_stage(FAMILY, PRESETS["tiny"], device="meta", parallel=ParallelConfig(tp=4, etp=2, sequence_parallel=True))
    assert main(["--list-architectures"]) == 0
    assert "GptOssForCausalLM            gpt-oss family" in capsys.readouterr().out
