"""Stages built separately hold the full model's parameters under the same global names, and
composed they compute the full model's function."""

from __future__ import annotations

import pytest
import torch

from mega.core.build import build_stage
from mega.core.model_family import Stage
from mega.core.pipeline.tied import tied_parameters
from mega.models.gpt.family import FAMILY as GPT
from mega.models.llama.family import FAMILY as LLAMA

FAMILIES = {"gpt": GPT, "llama": LLAMA}


def four_layer_config(family):
    return family.preset("tiny", num_layers=4, vocab_size=256, seq_length=16, hidden_dropout=0.0,
                         attention_dropout=0.0)


@pytest.mark.parametrize("name", FAMILIES)
def test_two_stages_hold_and_compute_the_full_model(name):
    family = FAMILIES[name]
    config = four_layer_config(family)
    full = build_stage(family, config, seed=11)
    first, last = (build_stage(family, config, stage, seed=11) for stage in family.pipeline_stages(config, 2))

    full_params = dict(full.named_parameters())
    tied = not config.untie_embeddings_and_output_weights
    for stage in (first, last):
        for param_name, param in stage.named_parameters():
            assert torch.equal(param, full_params[param_name]), param_name
    covered = set(dict(first.named_parameters())) | set(dict(last.named_parameters()))
    assert covered == set(full_params)
    assert "decoder.layers.2.self_attention.linear_qkv.weight" in dict(last.named_parameters())
    assert "decoder.layers.0.self_attention.linear_qkv.weight" not in dict(last.named_parameters())

    # Tied: the last stage holds a marked copy of the word embeddings and no output_layer.weight.
    last_names = set(dict(last.named_parameters()))
    assert ("embedding.word_embeddings.weight" in last_names) == tied
    assert ("output_layer.weight" in last_names) == (not tied)
    if tied:  # marked for mega.core.pipeline.tied on both stages
        assert tied_parameters([first]) == [first.embedding.word_embeddings.weight]
        assert tied_parameters([last]) == [last.embedding.word_embeddings.weight]
        assert last.output_layer.weight is last.embedding.word_embeddings.weight
    else:
        assert tied_parameters([first, last]) == []

    ids = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(0))
    hidden = first(ids)
    assert hidden.shape == (config.seq_length, 2, config.hidden_size)
    assert torch.equal(last(hidden), full(ids))


@pytest.mark.parametrize("name", FAMILIES)
def test_state_dict_uses_megatron_names_and_round_trips(name):
    family = FAMILIES[name]
    config = four_layer_config(family)
    model = build_stage(family, config, seed=3)
    state = model.state_dict()
    tied = not config.untie_embeddings_and_output_weights
    assert ("output_layer.weight" in state) == (not tied)
    expected = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
                "decoder.layers.3.input_layernorm.weight", "decoder.layers.3.pre_mlp_layernorm.weight",
                "decoder.layers.3.self_attention.linear_qkv.weight",
                "decoder.layers.3.self_attention.linear_proj.weight",
                "decoder.layers.3.mlp.linear_fc1.weight", "decoder.layers.3.mlp.linear_fc2.weight"}
    assert expected <= set(state)
    assert ("embedding.position_embeddings.weight" in state) == (name == "gpt")
    assert ("decoder.layers.3.self_attention.linear_qkv.bias" in state) == (name == "gpt")
    assert set(state) == set(dict(model.named_parameters()))  # no buffers, nothing twice

    other = build_stage(family, config, seed=4)
    other.load_state_dict(state)  # strict: the tied output weight comes from the embedding
    for param_name, param in other.named_parameters():
        assert torch.equal(param, state[param_name]), param_name
    if tied:
        assert other.output_layer.weight is other.embedding.word_embeddings.weight


def test_initialisation_follows_megatron():
    config = LLAMA.preset("tiny", num_layers=4, hidden_size=256, ffn_hidden_size=512, vocab_size=512,
                          init_method_std=0.05)
    model = build_stage(LLAMA, config, seed=0)
    params = dict(model.named_parameters())
    scaled_std = 0.05 / (2 * config.num_layers) ** 0.5
    for name, param in params.items():
        if name.endswith("layernorm.weight"):
            assert torch.all(param == 1), name
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            assert param.std().item() == pytest.approx(scaled_std, rel=0.05), name
        else:
            assert param.mean().abs().item() < 0.01 and param.std().item() == pytest.approx(0.05, rel=0.05), name
    # Every parameter draws from its own stream: no two weights are equal.
    assert not torch.equal(params["decoder.layers.0.mlp.linear_fc1.weight"], params["decoder.layers.1.mlp.linear_fc1.weight"])
    assert torch.equal(build_stage(LLAMA, config, seed=0).output_layer.weight, params["output_layer.weight"])
    assert not torch.equal(build_stage(LLAMA, config, seed=1).output_layer.weight, params["output_layer.weight"])


def test_a_stage_rejects_layers_outside_the_model():
    config = four_layer_config(GPT)
    with pytest.raises(ValueError, match="not consecutive layers of a 4-layer model"):
        build_stage(GPT, config, Stage(0, 1, {"decoder": range(2, 6)}))
