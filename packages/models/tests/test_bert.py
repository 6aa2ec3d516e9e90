"""One device, fp32: mega's ``bert`` family computes what Hugging Face's ``BertForPreTraining``
and ``BertForMaskedLM`` compute from the same weights (mapped by mega.models.bert.hf_bert), on a
padded batch of mixed lengths: last hidden states at the real tokens, MLM logits, the binary
head's logits, and Megatron's losses. Plus the family's config, flags and formulas."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from mega.core.build import build_stage  # noqa: E402
from mega.core.model_family import LossContext  # noqa: E402
from mega.core.plugins import get_plugins  # noqa: E402
from mega.models import hf_mapping  # noqa: E402
from mega.models.bert.config import BertConfig  # noqa: E402
from mega.models.bert.family import FAMILY, bert_floating_point_operations, bert_num_parameters  # noqa: E402
from mega.models.bert.hf_bert import BERT, bert_config, bert_hf_config  # noqa: E402
from mega.models.config import ModelConfigError  # noqa: E402
from mega.models.flops import num_floating_point_operations  # noqa: E402

BATCH, SEQ, VOCAB = 3, 12, 250
LENGTHS = (12, 7, 3)  # mixed lengths, padded to SEQ


def hf_bert(architecture: str):
    hf_config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        initializer_range=0.2, architectures=[architecture])  # large weights: differences show
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(hf_config).eval()
    with torch.no_grad():  # Hugging Face starts biases and norms at 0 and 1: make them count
        for name, param in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    text = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
    padding = (torch.arange(SEQ)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    types = (torch.arange(SEQ)[None, :] >= 4).long() * padding
    loss_mask = (torch.rand(BATCH, SEQ, generator=generator) < 0.4).float() * padding
    loss_mask[:, 0] = 1.0
    labels = torch.where(loss_mask > 0, torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator), -1)
    return {"text": text * padding, "types": types, "padding_mask": padding, "labels": labels,
            "loss_mask": loss_mask, "is_random": torch.tensor([0, 1, 1])}


def mega_from_hf(hf_model, config: BertConfig):
    model = build_stage(FAMILY, config, init=False)
    model.load_state_dict(hf_mapping.hf_to_mega(BERT, hf_model.state_dict(), config))
    return model.eval()


@pytest.mark.parametrize("architecture", ["BertForPreTraining", "BertForMaskedLM"])
def test_bert_matches_hugging_face(architecture, assert_close):
    hf_model = hf_bert(architecture)
    config = bert_config(hf_model.config.to_dict())
    assert config.bert_binary_head == (architecture == "BertForPreTraining")
    model, inputs = mega_from_hf(hf_model, config), batch()
    real = inputs["padding_mask"].bool()
    with torch.no_grad():
        expected = hf_model(input_ids=inputs["text"], token_type_ids=inputs["types"],
                            attention_mask=inputs["padding_mask"], output_hidden_states=True)
        hidden = model.encode(inputs).transpose(0, 1)
        outputs = model(inputs)
    assert_close(hidden[real], expected.hidden_states[-1][real], what="last hidden states")
    hf_logits = expected.prediction_logits if architecture == "BertForPreTraining" else expected.logits
    logits = outputs["logits"].transpose(0, 1)
    assert logits.shape[-1] == config.padded_vocab_size() > VOCAB
    assert_close(logits[..., :VOCAB][real], hf_logits[real], what="MLM logits")

    loss, metrics = FAMILY.loss(outputs, inputs, LossContext(config, None, model.kernels))
    mask = inputs["loss_mask"].bool()
    lm_loss = F.cross_entropy(hf_logits[mask], inputs["labels"][mask])
    assert_close(metrics["lm loss"], lm_loss, what="lm loss")
    if architecture == "BertForPreTraining":
        assert_close(outputs["binary_logits"], expected.seq_relationship_logits, what="binary logits")
        sop_loss = F.cross_entropy(expected.seq_relationship_logits, inputs["is_random"])
        assert_close(metrics["sop loss"], sop_loss, what="sop loss")
        assert_close(loss, lm_loss + sop_loss, what="total loss")
    else:
        assert "binary_logits" not in outputs and set(metrics) == {"lm loss"}


def test_hf_mapping_round_trips_every_tensor():
    hf_model = hf_bert("BertForPreTraining")
    config = bert_config(hf_model.config.to_dict())
    state = {k: v for k, v in hf_model.state_dict().items() if not k.startswith("cls.predictions.decoder")}
    state.pop("bert.embeddings.position_ids", None)
    back = hf_mapping.mega_to_hf(BERT, hf_mapping.hf_to_mega(BERT, state, config), config)
    assert set(back) == set(state)
    assert all(torch.equal(back[name], state[name]) for name in state)
    written = bert_hf_config(config)
    assert written["architectures"] == ["BertForPreTraining"] and bert_config(written) == config


def test_parameter_count_and_flops_follow_the_model():
    config = FAMILY.preset("tiny", vocab_size=300)
    for binary_head in (True, False):
        variant = dataclasses.replace(config, bert_binary_head=binary_head)
        model = build_stage(FAMILY, variant, device="meta")
        assert bert_num_parameters(variant) == sum(p.numel() for p in model.parameters())
    # An encoder counts the whole attention matrix: more than the causal count, by the halved half.
    h, s = config.hidden_size, config.seq_length
    causal = num_floating_point_operations(config, 4, causal=True)
    full = num_floating_point_operations(config, 4, causal=False)
    assert full - causal == pytest.approx(3 * 2 * 4 * s * config.num_layers * s * h)
    heads = 3 * 2 * 4 * s * h * h + 3 * 2 * 4 * (h * h + 2 * h)
    assert bert_floating_point_operations(config, 4) == pytest.approx(full + heads)


def test_presets_flags_and_refusals():
    family = get_plugins().models.get("bert")
    assert family is FAMILY and set(FAMILY.presets) == {"tiny", "base", "large", "minilm-l6"}
    base = FAMILY.preset("base")
    assert bert_num_parameters(dataclasses.replace(base, make_vocab_size_divisible_by=1)) == 110_106_428
    from mega.train.command import parse_run

    common = ["--model-family", "bert", "--model-preset", "tiny", "--mock-data"]
    assert parse_run(common)[0].model.bert_binary_head
    assert not parse_run([*common, "--bert-no-binary-head"])[0].model.bert_binary_head
    assert parse_run([*common, "--bert-no-binary-head", "--bert-binary-head"])[0].model.bert_binary_head
    with pytest.raises(ModelConfigError, match="--swiglu"):
        FAMILY.preset("tiny", swiglu=True)
    with pytest.raises(ModelConfigError, match="--normalization"):
        FAMILY.preset("tiny", normalization="RMSNorm")
