"""One device, fp32: mega's T5 computes what Hugging Face's ``T5ForConditionalGeneration``
computes (v1.0: ReLU, tied head with d_model**-0.5 scaling; v1.1: gated-GELU, untied), given
the same weights mapped by mega.models.t5.hf_t5, on a batch whose encoder inputs are padded to
different lengths. At tp2 (and tp2 with sequence parallelism) the gathered logits are the same.
Also checks the relative-position buckets against Hugging Face's own function."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mega.core.build import build_stage  # noqa: E402
from mega.models import hf_mapping  # noqa: E402
from mega.models.t5.family import FAMILY  # noqa: E402
from mega.models.t5.hf_t5 import T5_MAPPING, t5_config, t5_hf_config  # noqa: E402
from mega.models.t5.relative_position import relative_position_bucket  # noqa: E402

BATCH, ENC, DEC, VOCAB = 3, 12, 8, 120
VARIANTS = {
    "v1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
    "v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}


def hf_model(variant: str):
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
                                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                   dropout_rate=0.0, **VARIANTS[variant])
    torch.manual_seed(len(variant))
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms start at 1: make them count
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return untie_v1_1(model)


def untie_v1_1(model):
    """transformers 5 builds every T5 with lm_head tied to the embedding (a v1.1 config only
    turns the scaling off); v1.1 checkpoints have their own lm_head, as here."""
    if not model.config.scale_decoder_outputs:
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    return model


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    enc_mask = torch.ones(BATCH, ENC, dtype=torch.long)
    enc_mask[1, 7:] = 0  # mixed lengths: padded encoder inputs
    enc_mask[2, 10:] = 0
    return {"text_enc": torch.randint(2, VOCAB, (BATCH, ENC), generator=generator),
            "text_dec": torch.randint(2, VOCAB, (BATCH, DEC), generator=generator),
            "enc_mask": enc_mask, "dec_mask": torch.ones(BATCH, DEC, dtype=torch.long),
            "labels": torch.randint(2, VOCAB, (BATCH, DEC), generator=generator),
            "loss_mask": torch.ones(BATCH, DEC)}


def hf_logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=inputs["text_enc"], attention_mask=inputs["enc_mask"],
                     decoder_input_ids=inputs["text_dec"]).logits


def mega_config(model):
    return t5_config(model.config.to_dict(), seq_length=ENC, decoder_seq_length=DEC)


class _Tensors(dict):
    """Global tensors by mega name: a checkpoint source the core's loader cuts each rank's pieces from."""

    def get(self, name):
        return self[name]


def mega_model(model, groups=None):
    from mega.core.checkpoint import load_model_weights

    config = mega_config(model)
    stage = build_stage(FAMILY, config, groups=groups, init=False)
    load_model_weights(_Tensors(hf_mapping.hf_to_mega(T5_MAPPING, model.state_dict(), config)), [stage], groups)
    return stage.eval(), config


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_loss_match_transformers(variant, assert_close):
    model = hf_model(variant)
    inputs = batch()
    expected = hf_logits(model, inputs)
    stage, config = mega_model(model)
    assert config.gated == (variant == "v1.1")
    with torch.no_grad():
        logits = stage(inputs)["logits"]
    assert logits.shape == (DEC, BATCH, config.padded_vocab_size())
    assert_close(logits.transpose(0, 1)[..., :VOCAB], expected, what=f"{variant} logits")
    loss, metrics = FAMILY.loss({"logits": logits}, inputs, _loss_context(config))
    with torch.no_grad():
        reference = model(input_ids=inputs["text_enc"], attention_mask=inputs["enc_mask"],
                          decoder_input_ids=inputs["text_dec"], labels=inputs["labels"]).loss
    assert_close(loss, reference, what=f"{variant} loss")
    assert metrics["lm loss"] == loss


def _loss_context(config, tp_group=None):
    from mega.core.kernels import Kernels
    from mega.core.model_family import LossContext

    return LossContext(config, tp_group, Kernels())


def test_config_json_round_trips():
    for variant in VARIANTS:
        model = hf_model(variant)
        config = mega_config(model)
        written = t5_hf_config(config)
        again = t5_config(written, seq_length=ENC, decoder_seq_length=DEC)
        assert again == config
        rebuilt = transformers.T5Config(**written)
        assert rebuilt.is_gated_act == model.config.is_gated_act
        assert rebuilt.dense_act_fn == model.config.dense_act_fn
    with pytest.raises(ValueError, match="feed_forward_proj 'gated-silu'"):
        t5_config({"feed_forward_proj": "gated-silu"})


@pytest.mark.parametrize("bidirectional", [True, False])
def test_buckets_match_transformers(bidirectional):
    from transformers.models.t5.modeling_t5 import T5Attention

    offsets = torch.arange(-300, 300)[None, :] - torch.arange(0, 7)[:, None]
    for buckets, distance in ((32, 128), (8, 20)):
        expected = T5Attention._relative_position_bucket(offsets, bidirectional=bidirectional,
                                                         num_buckets=buckets, max_distance=distance)
        got = relative_position_bucket(offsets, bidirectional=bidirectional, num_buckets=buckets,
                                       max_distance=distance)
        assert torch.equal(got, expected)


def tensor_parallel_logits(variants: list[str], sequence_parallel: bool):
    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.core.parallel.collectives import gather_along

    groups = ParallelGroups(ParallelConfig(tp=2, sequence_parallel=sequence_parallel))
    results = {}
    for variant in variants:
        stage, config = mega_model(hf_model(variant), groups)
        with torch.no_grad():
            logits = stage(batch())["logits"]
            loss, _ = FAMILY.loss({"logits": logits}, batch(), _loss_context(config, groups.tp))
        results[variant] = gather_along(logits, groups.tp, dim=-1).transpose(0, 1)[..., :VOCAB], loss
    return results


def tp_layouts(variants):
    return {"tp2": tensor_parallel_logits(variants, False), "tp2-sp": tensor_parallel_logits(variants, True)}


def test_tensor_parallel_logits_match_transformers(worlds, assert_close):
    ranks = worlds.run(2, tp_layouts, list(VARIANTS))
    for variant in VARIANTS:
        model, inputs = hf_model(variant), batch()
        expected = hf_logits(model, inputs)
        with torch.no_grad():
            expected_loss = model(input_ids=inputs["text_enc"], attention_mask=inputs["enc_mask"],
                                  decoder_input_ids=inputs["text_dec"], labels=inputs["labels"]).loss
        for rank, results in enumerate(ranks):
            for layout, per_variant in results.items():
                logits, loss = per_variant[variant]
                assert_close(logits, expected, what=f"{variant} {layout} rank {rank}")
                assert_close(loss, expected_loss, what=f"{variant} {layout} rank {rank} loss")
