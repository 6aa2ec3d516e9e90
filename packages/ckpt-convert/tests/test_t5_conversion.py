"""T5 (``T5ForConditionalGeneration``, v1.0 and v1.1) through mega: HF -> mega (tp2 x pp2) -> HF
keeps every tensor bit for bit and the tokenizer files; the mega checkpoint, loaded into a
stage, computes transformers' logits; the result loads with transformers."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_test_models import safetensors_of, save_hf_model  # noqa: E402

transformers = pytest.importorskip("transformers")

from mega.ckpt_convert import WriteOptions, convert  # noqa: E402
from mega.core.checkpoint import read_metadata, tensor_shapes  # noqa: E402

VOCAB = 300
VARIANTS = {
    "t5-v1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
    "t5-v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def t5_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5")
    dirs = {}
    for variant, settings in VARIANTS.items():
        config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                       num_decoder_layers=2, num_heads=4, dropout_rate=0.0, **settings)
        torch.manual_seed(len(variant))
        model = transformers.T5ForConditionalGeneration(config).eval()
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 1:
                    param.add_(torch.randn_like(param) * 0.1)
            if not model.config.scale_decoder_outputs:  # v1.1: its own lm_head (transformers 5 ties it)
                model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
        dirs[variant] = save_hf_model(model, root / variant)
    return dirs


def t5_logits(directory, ids, decoder_ids):
    model = transformers.T5ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids, decoder_input_ids=decoder_ids).logits


@pytest.mark.parametrize("variant", VARIANTS)
def test_t5_round_trips_through_tp2_pp2(variant, t5_dirs, tmp_path, assert_close):
    from mega.core.build import build_stage
    from mega.core.checkpoint import load_model_weights
    from mega.core.plugins import get_plugins

    source, sharded, back = t5_dirs[variant], tmp_path / "tp2pp2", tmp_path / "hf"
    convert(source, sharded, to_format="mega", options=WriteOptions(tensor_parallel_size=2, pipeline_parallel_size=2))
    convert(sharded, back, to_format="hf")
    metadata = read_metadata(sharded)
    assert (metadata.layout["tp"], metadata.layout["pp"], metadata.model_family) == (2, 2, "t5")
    assert tensor_shapes(sharded)["embedding.word_embeddings.weight"][0][0] == 512  # 300 padded for tp 2
    expected, actual = safetensors_of(source), safetensors_of(back)
    assert set(actual) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (back / name).read_bytes() == (source / name).read_bytes(), name

    ids = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    decoder_ids = torch.randint(2, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    reference = t5_logits(source, ids, decoder_ids)
    assert torch.equal(t5_logits(back, ids, decoder_ids), reference)
    # The mega checkpoint in a one-process stage computes the same logits.
    family = get_plugins().models.get("t5")
    config = family.hf_mapping.config_from_hf(transformers.T5Config.from_pretrained(source).to_dict(),
                                              seq_length=9, decoder_seq_length=5)
    stage = build_stage(family, config, init=False)
    load_model_weights(str(sharded), [stage])
    ones = torch.ones_like
    with torch.no_grad():
        logits = stage.eval()({"text_enc": ids, "text_dec": decoder_ids, "enc_mask": ones(ids),
                               "dec_mask": ones(decoder_ids)})["logits"]
    assert_close(logits.transpose(0, 1)[..., :VOCAB], reference, what=variant)
