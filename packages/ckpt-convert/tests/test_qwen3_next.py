"""The ``qwen3-next`` family against transformers' ``Qwen3NextForCausalLM``, on the CPU in fp32.

A tiny random model with every feature on (four layers: Gated DeltaNet, gated attention, Gated
DeltaNet, gated attention; grouped value heads; partial RoPE; four experts top-2 with a gated
shared expert; every norm off its start) saved by transformers: converted to mega, its logits
and loss equal transformers' (1e-5 relative); mega -> Hugging Face gives back the files' tensors
bit for bit and a config.json transformers builds the same model from; greedy generation over 32
tokens equals transformers' ``generate`` for prompts of several lengths at once through
``mega generate`` and ``mega serve`` (``PUT /api``), and for requests joining a running batch
whose state slots are freed and reused (two slots, three requests), prefilled in chunks. At tp2
(one world of 2 gloo ranks, both kinds of heads split) the served greedy tokens (leader and
follower, each rank's states its own heads') equal transformers' too. The training
layouts are tests/test_qwen3_next_training.py's (which give one process's losses, so transformers'
logits at tp2 too).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_test_models import (  # noqa: E402
    VOCAB,
    generation_engine,
    input_ids,
    mega_generate_records,
    save_hf_model,
    tensor_parallel_greedy,
    tiny_random_model,
)

transformers = pytest.importorskip("transformers")

from mega.ckpt_convert import convert  # noqa: E402

SETTINGS = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                num_experts=4, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=64,
                full_attention_interval=2, partial_rotary_factor=0.5, initializer_range=0.1)
PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [11, 12, 13, 14, 15, 16, 17, 18, 19], [7],
           [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]]
NEW_TOKENS = 32
EOD = VOCAB - 1  # NullTokenizer's end of document: it stops both sides


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    hf_model = tiny_random_model("Qwen3NextForCausalLM", "Qwen3NextConfig", SETTINGS, "qwen3-next")
    root = tmp_path_factory.mktemp("qwen3-next")
    hf_dir = save_hf_model(hf_model, root / "hf")
    convert(hf_dir, root / "mega", to_format="mega")
    return hf_model, hf_dir, root / "mega"


GREEDY: dict[tuple[int, ...], list[int]] = {}  # transformers' continuations, made once per prompt


def hf_greedy(hf_model, prompt: list[int], eos: int | None = None) -> list[int]:
    """transformers' greedy prompt + 32 tokens, cut after the first ``eos``."""
    if tuple(prompt) not in GREEDY:
        GREEDY[tuple(prompt)] = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                                  eos_token_id=None, pad_token_id=0)[0].tolist()
    tokens = GREEDY[tuple(prompt)]
    new = tokens[len(prompt):]
    return tokens if eos not in new else tokens[:len(prompt) + new.index(eos) + 1]


def test_logits_and_loss_equal_transformers(case, assert_close):
    from test_layout_logits import stage_logits

    from mega.core.parallel import ParallelConfig, ParallelGroups

    hf_model, _, mega_dir = case
    ids = input_ids()
    with torch.no_grad():
        expected = hf_model(ids, labels=ids)
    logits, loss = stage_logits(str(mega_dir), ids, ParallelGroups(ParallelConfig()))
    assert_close(logits, expected.logits, what="logits")
    assert_close(loss, expected.loss, what="loss")


def test_mega_to_hugging_face_is_bit_exact(case, tmp_path):
    from safetensors.torch import load_file

    hf_model, hf_dir, mega_dir = case
    convert(mega_dir, tmp_path / "back", to_format="hf")
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    config = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert type(config).__name__ == "Qwen3NextConfig"
    for key in ("layer_types", "linear_num_value_heads", "shared_expert_intermediate_size", "head_dim"):
        assert getattr(config, key) == getattr(hf_model.config, key), key
    assert config.rope_parameters["partial_rotary_factor"] == 0.5


def test_mega_generate_equals_transformers_greedy(case, capsys):
    """``mega generate`` on the converted checkpoint, prompts of several lengths in one run."""
    hf_model, hf_dir, mega_dir = case
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    records = mega_generate_records(mega_dir, ["the quick brown fox jumps over", "pack my box"], NEW_TOKENS, capsys)
    for record in records:
        ids = tokenizer.encode(record["prompt"])
        expected = hf_greedy(hf_model, ids, tokenizer.eos_token_id)[len(ids):]
        assert record["tokens"] == expected, record["prompt"]


def test_mega_serve_equals_transformers_greedy(case):
    """``mega serve``'s whole ``main`` (mega-inference's tests' in-process server): one ``PUT /api``
    of prompts of several lengths, ids as text."""
    pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "inference", "tests"))
    from in_process_server import serving

    hf_model, _, mega_dir = case
    argv = ["--load", str(mega_dir), "--device", "cpu", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(EOD)]
    with serving(argv) as send:
        reply = send("PUT", "/api", {"prompts": [" ".join(map(str, prompt)) for prompt in PROMPTS],
                                     "tokens_to_generate": NEW_TOKENS, "top_k": 1})
    assert reply.status_code == 200, reply.text
    for prompt, tokens in zip(PROMPTS, reply.json()["tokens"], strict=True):
        assert tokens == hf_greedy(hf_model, prompt, EOD), prompt


def test_requests_joining_a_running_batch_equal_transformers(case):
    """Two state slots for three requests submitted one after the other: the third waits for a
    slot to be freed and starts from zeros there; with --max-num-batched-tokens 4 the prompts are
    prefilled in chunks continuing their states while the others decode."""
    from test_hf_bridge import staggered

    from mega.inference.engine import GenerationRequest
    from mega.inference.engine.continuous import ContinuousBatchingWorker

    hf_model, _, mega_dir = case
    worker = ContinuousBatchingWorker(generation_engine(mega_dir), max_batch_size=2, max_num_tokens=128,
                                      block_size=8, max_num_batched_tokens=4)
    prompts = [PROMPTS[3], PROMPTS[0], PROMPTS[1]]
    worker.start()
    try:
        results = asyncio.run(staggered(worker, [GenerationRequest(prompt, NEW_TOKENS) for prompt in prompts]))
    finally:
        worker.stop()
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == hf_greedy(hf_model, prompt), prompt
    assert sorted(worker.allocator._free_slots) == [0, 1], "every state slot is free again"


def test_what_a_recurrent_state_cannot_do_is_off_or_refused_by_name(case, caplog):
    """Prefix caching and the static slot cache are off for the family (said in the log: the loop
    keeps the paged cache with state slots); speculative decoding is refused naming it."""
    from mega.inference.engine.continuous import ContinuousBatchingWorker
    from mega.inference.engine.kv_caches import RecurrentSequenceCache

    engine = generation_engine(case[2])
    with caplog.at_level("INFO"):
        worker = ContinuousBatchingWorker(engine, max_batch_size=2, prefix_caching=True, static_cache=True)
    assert isinstance(worker.kv, RecurrentSequenceCache) and not worker.prefix_caching
    assert "prefix caching is off" in caplog.text and "static KV cache" in caplog.text and "qwen3-next" in caplog.text
    with pytest.raises(ValueError, match="speculative decoding.*qwen3-next"):
        ContinuousBatchingWorker(engine, max_batch_size=2, speculator=object())


def test_tensor_parallel_generation_equals_transformers(case, worlds):
    hf_model, _, mega_dir = case
    leader, follower = worlds.run(2, tensor_parallel_greedy, str(mega_dir), PROMPTS, NEW_TOKENS)
    assert follower is None
    assert leader == [hf_greedy(hf_model, prompt) for prompt in PROMPTS], "tp2 greedy generation"


def with_mtp_module(hf_model, hf_dir, directory):
    """A copy of ``hf_dir`` with a released checkpoint's MTP module (``mtp_num_hidden_layers: 1``
    and random ``mtp.*`` tensors, which transformers does not load), and those modules built from
    transformers' own classes with the same weights."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    shutil.copytree(hf_dir, directory)
    config = hf_model.config
    torch.manual_seed(3)
    modules = torch.nn.ModuleDict({
        "layer": hf.Qwen3NextDecoderLayer(config, layer_idx=1),  # a full-attention layer
        "fc": torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False),
        **{name: hf.Qwen3NextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
           for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}).eval()
    with torch.no_grad():
        for param in modules.parameters():
            param.copy_(torch.randn_like(param) * (0.1 if param.dim() == 1 else 0.2))
    tensors = load_file(directory / "model.safetensors")
    for name, tensor in modules.state_dict().items():
        name = name.replace("layer.", "layers.0.", 1)
        if name.endswith("experts.gate_up_proj"):  # the files hold each expert's projections
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2)
                tensors[f"mtp.{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate.contiguous()
                tensors[f"mtp.{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith("experts.down_proj"):
            for e, down in enumerate(tensor):
                tensors[f"mtp.{name[:-len('down_proj')]}{e}.down_proj.weight"] = down.contiguous()
        else:
            tensors[f"mtp.{name}"] = tensor.contiguous()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config_json = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config_json, "mtp_num_hidden_layers": 1}))
    return modules


def test_multi_token_prediction_converts_and_computes_as_transformers_modules(case, tmp_path, assert_close):
    """transformers ignores the MTP module; mega converts it both ways bit for bit and computes
    ``norm(layer(fc([e_norm(embed(next tokens)); h_norm(final hidden)])))`` through the output
    layer as transformers' own modules (Qwen3NextDecoderLayer, Qwen3NextRMSNorm) do with its weights."""
    from safetensors.torch import load_file

    from mega.ckpt_convert import open_checkpoint
    from mega.core.build import build_stage
    from mega.core.checkpoint import load_model_weights
    from mega.core.plugins import get_plugins

    hf_model, hf_dir, _ = case
    mtp = with_mtp_module(hf_model, hf_dir, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mega", to_format="mega")
    with open_checkpoint(str(tmp_path / "mega")) as source:
        family, config = get_plugins().models.get(source.family), source.config
    assert config.mtp_num_layers == 1
    model = build_stage(family, config, init=False, training=False)
    load_model_weights(str(tmp_path / "mega"), [model.eval()])
    ids = input_ids()
    with torch.no_grad():
        outputs = model({"tokens": ids})
        hidden = hf_model.model(ids).last_hidden_state
        following = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        joined = torch.cat([mtp["pre_fc_norm_embedding"](hf_model.model.embed_tokens(following)),
                            mtp["pre_fc_norm_hidden"](hidden)], dim=-1)
        x = mtp["fc"](joined)
        positions = torch.arange(ids.shape[1])[None]
        x = mtp["layer"](x, position_embeddings=hf_model.model.rotary_emb(x, positions), attention_mask=None,
                         position_ids=positions)
        expected = hf_model.lm_head(mtp["norm"](x))
    assert_close(outputs["mtp_logits"][0].transpose(0, 1)[..., :VOCAB], expected, what="MTP logits")
    assert_close(outputs["logits"].transpose(0, 1)[..., :VOCAB], hf_model(ids).logits, what="logits")
    convert(tmp_path / "mega", tmp_path / "back", to_format="hf")
    original, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original) and any(name.startswith("mtp.") for name in back)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    assert json.loads((tmp_path / "back" / "config.json").read_text())["mtp_num_hidden_layers"] == 1
