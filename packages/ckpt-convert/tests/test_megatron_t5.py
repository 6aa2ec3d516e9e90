"""Megatron-LM T5 checkpoints against megatron-core's own ``T5Model``: a genuine torch_dist
checkpoint (``dist_checkpointing.save`` by a tp 2 gloo world) and the legacy files of the same tp 2
run import as exactly megatron-core's tensors at other layouts; exports load back into megatron-core
(``dist_checkpointing.load``, strict ``load_state_dict``) with equal tensors. megatron-core's forward
does not run on a CPU, so what the imported model computes is checked against transformers' T5 made
to follow megatron-core's conventions (queries scaled by 1/sqrt(d), an unscaled tied output layer
with a bias, exact GELU), and the relative-position bias against megatron-core's own module.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

import megatron_t5_reference as t5_ref  # noqa: E402
from megatron_reference import made_by_megatron_core  # noqa: E402
from test_megatron import _refused, assert_imports_as, assert_same_model  # noqa: E402

from mega.ckpt_convert import ConversionError, WriteOptions, convert  # noqa: E402
from mega.core.checkpoint import read_metadata  # noqa: E402


@pytest.fixture(scope="module")
def made(world, tmp_path_factory):
    """The tp 2 T5 checkpoints megatron-core wrote, and its tp 1 view of the model (the truth)."""
    return made_by_megatron_core(world, tmp_path_factory.mktemp("megatron-t5"), t5_ref.save_t5,
                                 t5_ref.load_t5_torch_dist)


@pytest.mark.parametrize(("checkpoint", "layout"), [("tp2", (1, 1)), ("tp2", (2, 1)), ("legacy", (1, 1))])
def test_t5_import_gives_megatron_cores_tensors(checkpoint, layout, made, tmp_path):
    root, truth = made
    assert_imports_as(root / checkpoint, truth, layout, tmp_path)


def test_t5_exports_load_in_megatron_core(made, world, tmp_path):
    """megatron legacy -> mega -> torch_dist at tp 2 and 1, and -> legacy at tp 2: megatron-core loads
    each with the tensors of the original checkpoint."""
    root, _ = made
    convert(root / "legacy", tmp_path / "mega", from_format="megatron", to_format="mega")
    for tp in (2, 1):
        exported = tmp_path / f"tp{tp}"
        convert(tmp_path / "mega", exported, to_format="megatron",
                options=WriteOptions(tensor_parallel_size=tp, megatron_format="torch_dist", iteration=7))
        loaded = world.run(t5_ref.load_t5_torch_dist, tp, str(exported / "iter_0000007"))
        original = world.run(t5_ref.load_t5_torch_dist, tp, str(root / "tp2" / "iter_0000007"))
        for rank in range(2):
            assert loaded[rank].keys() == original[rank].keys()
            for name, tensor in loaded[rank].items():
                assert torch.equal(tensor, original[rank][name]), (tp, rank, name)
    convert(tmp_path / "mega", tmp_path / "legacy", to_format="megatron",
            options=WriteOptions(tensor_parallel_size=2, megatron_format="legacy", iteration=7))
    loaded = world.run(t5_ref.load_t5_legacy, 2, str(tmp_path / "legacy"), 7)
    for rank in range(2):
        original = torch.load(root / "legacy" / "iter_0000007" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt",
                              weights_only=False)["model"]
        for name, tensor in loaded[rank].items():
            assert torch.equal(tensor, original[name]), (rank, name)


def _transformers_t5_as_megatron_core(state: dict[str, torch.Tensor]):
    """transformers' T5 holding the imported weights, changed to compute as megatron-core's T5:
    queries scaled by 1/sqrt(kv_channels) (exact for 16: 0.25), exact GELU, the tied output layer
    fed the decoder's output unscaled (an untied lm_head holding the embedding)."""
    shape = t5_ref.SHAPE
    heads, d = shape["num_attention_heads"], shape["kv_channels"]
    config = transformers.T5Config(vocab_size=t5_ref.VOCAB, d_model=shape["hidden_size"], d_kv=d,
                                   d_ff=shape["ffn_hidden_size"], num_layers=t5_ref.ENCODER_LAYERS,
                                   num_decoder_layers=t5_ref.DECODER_LAYERS, num_heads=heads, dropout_rate=0.0,
                                   feed_forward_proj="gelu", tie_word_embeddings=False, layer_norm_epsilon=1e-6)
    model = transformers.T5ForConditionalGeneration(config).eval()

    def heads_of(weight, parts):  # Megatron's [per head: q, k, v] rows -> each part's rows
        return [rows.reshape(-1, weight.shape[1]) for rows in weight.view(heads, parts, d, -1).unbind(1)]

    weights = {"shared.weight": state["embedding.word_embeddings.weight"][:t5_ref.VOCAB],
               "lm_head.weight": state["embedding.word_embeddings.weight"][:t5_ref.VOCAB]}
    for stack, count in (("encoder", t5_ref.ENCODER_LAYERS), ("decoder", t5_ref.DECODER_LAYERS)):
        weights[f"{stack}.final_layer_norm.weight"] = state[f"{stack}.final_layernorm.weight"]
        weights[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = \
            state[f"{stack}_relative_pos_emb.relative_attention_bias.weight"]
        for n in range(count):
            ours, theirs = f"{stack}.layers.{n}.", f"{stack}.block.{n}.layer."
            q, k, v = heads_of(state[ours + "self_attention.linear_qkv.weight"], 3)
            mlp = 2 if stack == "decoder" else 1
            weights.update({
                theirs + "0.layer_norm.weight": state[ours + "input_layernorm.weight"],
                theirs + "0.SelfAttention.q.weight": q * d ** -0.5, theirs + "0.SelfAttention.k.weight": k,
                theirs + "0.SelfAttention.v.weight": v,
                theirs + "0.SelfAttention.o.weight": state[ours + "self_attention.linear_proj.weight"],
                theirs + f"{mlp}.layer_norm.weight": state[ours + "pre_mlp_layernorm.weight"],
                theirs + f"{mlp}.DenseReluDense.wi.weight": state[ours + "mlp.linear_fc1.weight"],
                theirs + f"{mlp}.DenseReluDense.wo.weight": state[ours + "mlp.linear_fc2.weight"]})
            if stack == "decoder":
                k, v = heads_of(state[ours + "cross_attention.linear_kv.weight"], 2)
                weights.update({
                    theirs + "1.layer_norm.weight": state[ours + "pre_cross_attn_layernorm.weight"],
                    theirs + "1.EncDecAttention.q.weight": state[ours + "cross_attention.linear_q.weight"] * d ** -0.5,
                    theirs + "1.EncDecAttention.k.weight": k, theirs + "1.EncDecAttention.v.weight": v,
                    theirs + "1.EncDecAttention.o.weight": state[ours + "cross_attention.linear_proj.weight"]})
    missing, _ = model.load_state_dict(weights, strict=False)
    assert not [name for name in missing if "relative_attention_bias" not in name and "embed_tokens" not in name]
    return model


def test_the_imported_t5_computes_as_megatron_cores(made, world, tmp_path):
    from mega.core.build import build_stage
    from mega.core.checkpoint import load_model_weights, read_metadata, read_tensors, tensor_shapes
    from mega.core.plugins import get_plugins
    from mega.models.t5.relative_position import RelativePositionBias

    root, truth = made
    # megatron-core's relative-position bias (its module runs on the CPU) is mega's, both directions.
    for bidirectional in (True, False):
        (expected,) = world.run(t5_ref.relative_bias, bidirectional, 7, 9)[:1]
        ours = RelativePositionBias(32, 128, 4, bidirectional=bidirectional)
        with torch.no_grad():
            ours.relative_attention_bias.weight.copy_(torch.arange(32 * 4, dtype=torch.float32).view(32, 4))
            assert torch.equal(ours(7, 9).reshape(expected.shape), expected), bidirectional

    convert(root / "tp2", tmp_path / "mega", from_format="megatron", to_format="mega")
    config = read_metadata(tmp_path / "mega").model_config
    family = get_plugins().models.get("t5")
    stage = build_stage(family, family.config_class(**config), init=False)
    load_model_weights(str(tmp_path / "mega"), [stage])
    ids = torch.randint(2, t5_ref.VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    decoder_ids = torch.randint(2, t5_ref.VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    ones = torch.ones_like
    with torch.no_grad():
        ours = stage.eval()({"text_enc": ids, "text_dec": decoder_ids, "enc_mask": ones(ids),
                             "dec_mask": ones(decoder_ids)})["logits"].transpose(0, 1)[..., :t5_ref.VOCAB]
        state = read_tensors(tmp_path / "mega", list(tensor_shapes(tmp_path / "mega")))
        reference = _transformers_t5_as_megatron_core(state)(input_ids=ids, decoder_input_ids=decoder_ids).logits
    reference = reference + state["lm_head.output_layer.bias"][:t5_ref.VOCAB]
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(state["lm_head.output_layer.bias"], truth["lm_head.output_layer.bias"])


@pytest.fixture(scope="module")
def made_default(world, tmp_path_factory):
    """Megatron-LM's default T5 (learned absolute positions, LayerNorm, biases) as ``made``."""
    root = tmp_path_factory.mktemp("megatron-t5-default")
    world.run(t5_ref.save_t5, str(root / "tp2" / "iter_0000007"), str(root / "legacy"), 7, "megatron")
    truth = world.run(t5_ref.load_t5_torch_dist, 1, str(root / "tp2" / "iter_0000007"), "megatron")[0]
    return root, truth


def _mega_t5_logits(directory, ids: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
    """The mega checkpoint's forward: logits ``[b, decoder seq, padded vocab]``."""
    from mega.core.build import build_stage
    from mega.core.checkpoint import load_model_weights, read_metadata
    from mega.core.plugins import get_plugins

    family = get_plugins().models.get("t5")
    stage = build_stage(family, family.config_class(**read_metadata(directory).model_config), init=False)
    load_model_weights(str(directory), [stage])
    ones = torch.ones_like
    with torch.no_grad():
        return stage.eval()({"text_enc": ids, "text_dec": decoder_ids, "enc_mask": ones(ids),
                             "dec_mask": ones(decoder_ids)})["logits"].transpose(0, 1)


def test_megatron_lms_default_t5_converts_both_ways_and_computes_as_megatron_core(made_default, world, tmp_path):
    """Imports (torch_dist to tp 1, legacy to tp 2) hold megatron-core's tensors; what the import
    computes equals megatron-core's own forward; exports (torch_dist and legacy at tp 2) load
    back into megatron-core with the original tensors."""
    root, truth = made_default
    original = root / "tp2" / "iter_0000007"
    convert(root / "tp2", tmp_path / "mega", from_format="megatron", to_format="mega")
    assert_same_model(tmp_path / "mega", truth)
    config = read_metadata(tmp_path / "mega").model_config
    assert (config["position_embedding_type"], config["normalization"], config["add_bias_linear"],
            config["max_position_embeddings"]) == ("learned_absolute", "LayerNorm", True, t5_ref.ENCODER_SEQ)
    with pytest.raises(ConversionError, match="--position-embedding-type learned_absolute, --normalization LayerNorm"):
        convert(tmp_path / "mega", tmp_path / "hf", to_format="hf")  # no Hugging Face T5 computes it
    convert(root / "legacy", tmp_path / "mega-tp2", from_format="megatron", to_format="mega",
            options=WriteOptions(tensor_parallel_size=2))
    assert_same_model(tmp_path / "mega-tp2", truth)

    ids = torch.randint(2, t5_ref.VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    decoder_ids = torch.randint(2, t5_ref.VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    expected = world.run(t5_ref.t5_logits, str(original), "megatron", ids, decoder_ids)[0]
    torch.testing.assert_close(_mega_t5_logits(tmp_path / "mega", ids, decoder_ids), expected, rtol=1e-5, atol=1e-5)

    for megatron_format in ("torch_dist", "legacy"):
        exported = tmp_path / megatron_format
        convert(tmp_path / "mega", exported, to_format="megatron",
                options=WriteOptions(tensor_parallel_size=2, megatron_format=megatron_format, iteration=7))
        if megatron_format == "torch_dist":
            loaded = world.run(t5_ref.load_t5_torch_dist, 2, str(exported / "iter_0000007"), "megatron")
        else:
            loaded = world.run(t5_ref.load_t5_legacy, 2, str(exported), 7, "megatron")
        reference = world.run(t5_ref.load_t5_torch_dist, 2, str(original), "megatron")
        for rank in range(2):
            assert loaded[rank].keys() == reference[rank].keys()
            for name, tensor in loaded[rank].items():
                assert torch.equal(tensor, reference[rank][name]), (megatron_format, rank, name)


def test_t5_conversions_megatron_cannot_or_hugging_face_cannot_are_refused(made, tmp_path, capsys):
    root, _ = made
    convert(root / "tp2", tmp_path / "mega", from_format="megatron", to_format="mega")
    with pytest.raises(ConversionError, match="T5ForConditionalGeneration cannot compute this model"):
        convert(tmp_path / "mega", tmp_path / "hf", to_format="hf")
    with pytest.raises(ConversionError, match="mega reads and writes legacy encoder-decoder"):
        convert(tmp_path / "mega", tmp_path / "pp2", to_format="megatron",
                options=WriteOptions(pipeline_parallel_size=2, megatron_format="legacy"))
    # A Google T5 (unscaled attention, scaled tied output) is no model Megatron-LM computes.
    config = transformers.T5Config(vocab_size=t5_ref.VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "google")
    with pytest.raises(ConversionError, match="megatron-core's T5, which needs --feed-forward-proj gelu"):
        convert(tmp_path / "google", tmp_path / "megatron", from_format="hf", to_format="megatron",
                options=WriteOptions(megatron_format="torch_dist"))
    for refused in ("hf", "pp2", "megatron"):
        assert not (tmp_path / refused).exists()
    # Args that contradict the tensors: both named, nothing written.
    bad = tmp_path / "bad"
    shutil.copytree(root / "tp2", bad)
    common = bad / "iter_0000007" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].decoder_num_layers = 3
    torch.save(state, common)
    _refused(capsys, tmp_path, bad, "decoder.layers.2")
    state["args"].decoder_num_layers, state["args"].position_embedding_type = 2, "learned_absolute"
    torch.save(state, common)
    _refused(capsys, tmp_path, bad, "lacks embedding.position_embeddings.weight and holds decoder_relative_pos_emb")
    state["args"].position_embedding_type = "rope"  # no T5 mega computes
    torch.save(state, common)
    _refused(capsys, tmp_path, bad, "args.position_embedding_type is 'rope'; mega's t5 family computes "
                                    "'learned_absolute' or 'relative'")


def test_mega_train_loads_a_megatron_t5_directory(made, capsys):
    """On the fly, with the model flags of megatron-core's conventions; without them, told, not loaded."""
    from mega.train.command import main as train_main

    root, _ = made
    flags = ["--mock-data", "--model-family", "t5", "--num-layers", "3", "--decoder-num-layers", "2",
             "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96", "--kv-channels", "16",
             "--seq-length", "32", "--decoder-seq-length", "16", "--vocab-size", str(t5_ref.VOCAB),
             "--norm-epsilon", "1e-6", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
             "--train-iters", "1", "--eval-iters", "0", "--load", str(root / "legacy")]
    conventions = ["--feed-forward-proj", "gelu", "--softmax-scale", "0.25", "--no-scale-tied-output",
                   "--output-layer-bias"]
    assert train_main([*flags, *conventions]) == 0
    assert "loaded megatron legacy (--ckpt-format torch) checkpoint" in capsys.readouterr().out
    assert train_main(flags) == 2
    assert "does not match this model" in capsys.readouterr().err
