"""The ``qwen3`` family against transformers' ``Qwen3ForCausalLM`` (tiny random configs, fp32):
the same weights through the family's Hugging Face mapping give transformers' logits and loss,
tied and untied; Hugging Face -> mega -> Hugging Face is bit-exact; config.json round-trips.
(tp2 and tp2 + sequence parallelism against one process: tests/test_family_training.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from mega.core.build import build_stage  # noqa: E402
from mega.models import hf_mapping  # noqa: E402
from mega.models.qwen3.family import FAMILY, PRESETS  # noqa: E402
from mega.models.qwen3.hf_qwen3 import QWEN3, qwen3_config, qwen3_hf_config  # noqa: E402

BATCH, SEQ, VOCAB = 2, 16, 300


def make_qwen3(tied: bool):
    hf_config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=64, tie_word_embeddings=tied,
        initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(3)
    model = transformers.Qwen3ForCausalLM(hf_config).eval()
    with torch.no_grad():  # norms start at 1: make every value count
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_equal_transformers(tied, assert_close):
    hf_model = make_qwen3(tied)
    config = qwen3_config(hf_model.config.to_dict())
    assert config.qk_layernorm and config.kv_channels == 24 and config.untie_embeddings_and_output_weights != tied
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    model = build_stage(FAMILY, config, init=False)
    model.load_state_dict(hf_mapping.hf_to_mega(QWEN3, hf_model.state_dict(), config))
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        expected = hf_model(ids).logits
        logits = model.eval()(ids)
        assert_close(logits.transpose(0, 1)[..., :VOCAB], expected, what="qwen3 logits")
        reference = F.cross_entropy(expected.flatten(0, 1), labels.flatten(), reduction="none").view(BATCH, SEQ)
        assert_close(model.loss(logits, labels), reference, what="qwen3 loss")


def test_mapping_round_trips_bit_exactly():
    for tied in (True, False):
        hf_model = make_qwen3(tied)
        config = qwen3_config(hf_model.config.to_dict())
        original = hf_model.state_dict()
        back = hf_mapping.mega_to_hf(QWEN3, hf_mapping.hf_to_mega(QWEN3, original, config), config)
        assert set(back) == set(original) - ({"lm_head.weight"} if tied else set())
        for name, tensor in back.items():
            assert torch.equal(tensor, original[name]), name


def test_presets_round_trip_through_config_json():
    for name in ("0.6b", "8b", "32b"):
        config = PRESETS[name]
        hf = qwen3_hf_config(config)
        assert transformers.Qwen3Config(**hf).head_dim == 128
        assert qwen3_config(hf, seq_length=config.seq_length) == config
    # Sizes of the released models (their model cards: 0.6B with the tied embedding, 32.8B).
    assert round(FAMILY.num_parameters(PRESETS["0.6b"]) / 1e9, 2) == 0.60
    assert round(FAMILY.num_parameters(PRESETS["32b"]) / 1e9, 1) == 32.8


def test_what_qwen3_cannot_express_is_refused():
    with pytest.raises(ValueError, match="sliding-window"):
        qwen3_config(transformers.Qwen3Config(use_sliding_window=True).to_dict())
    with pytest.raises(ValueError, match="attention_bias"):
        qwen3_config(transformers.Qwen3Config(attention_bias=True).to_dict())
    with pytest.raises(ValueError, match="qk_layernorm"):
        qwen3_hf_config(PRESETS["tiny"].__class__(**{**PRESETS["tiny"].__dict__, "qk_layernorm": False}))
