"""Uneven pipeline layouts from Megatron's flags: the layers of every virtual stage, against the
counts megatron-core's own functions give for the same flags."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mega.core.pipeline.config import PipelineConfig
from mega.core.pipeline.layout import layers_per_stage, layout_string, parse_layout, uneven_candidates
from mega.core.pipeline.partition import PartitionError


def megatron_counts(num_layers, pp, vpp, **flags):
    """Layers per virtual stage (pipeline order) from megatron-core's get_num_layers_to_build."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    config = SimpleNamespace(
        num_layers=num_layers, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        pipeline_model_parallel_layout=None,
        num_layers_in_first_pipeline_stage=flags.get("first"), num_layers_in_last_pipeline_stage=flags.get("last"),
        account_for_embedding_in_pipeline_split=flags.get("embedding", False),
        account_for_loss_in_pipeline_split=flags.get("loss", False))
    return [get_num_layers_to_build(config, vp_stage=stage // pp if vpp > 1 else None, pp_rank=stage % pp)
            for stage in range(pp * vpp)]


CASES = [  # num_layers, pp, vpp, flags
    (8, 4, 1, {"first": 1, "last": 1}),
    (10, 4, 1, {"first": 1, "last": 1}),
    (9, 4, 1, {"last": 3}),
    (12, 4, 2, {"first": 2, "last": 2}),
    (6, 4, 1, {"embedding": True, "loss": True}),
    (7, 4, 2, {"embedding": True}),
    (14, 4, 2, {"embedding": True, "loss": True}),
]


@pytest.mark.parametrize(("num_layers", "pp", "vpp", "flags"), CASES)
def test_counts_match_megatron_core(num_layers, pp, vpp, flags):
    pipeline = PipelineConfig(decoder_first_pipeline_num_layers=flags.get("first"),
                              decoder_last_pipeline_num_layers=flags.get("last"),
                              account_for_embedding_in_pipeline_split=flags.get("embedding", False),
                              account_for_loss_in_pipeline_split=flags.get("loss", False))
    assert layers_per_stage(pipeline, num_layers, pp, vpp) == megatron_counts(num_layers, pp, vpp, **flags)


def test_layout_string_follows_megatron_grammar():
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    layout = "Et*3|(tt|)*29,m|L"
    ours = ["".join(stage) for stage in parse_layout(layout)]
    theirs = ["".join(layer.name[0] for layer in stage) for stage in PipelineParallelLayerLayout.parse_str_to_list(layout)]
    names = {"e": "E", "d": "t", "l": "L", "m": "m"}
    assert ours == ["".join(names[c] for c in stage) for stage in theirs]
    assert layers_per_stage(PipelineConfig(pipeline_model_parallel_layout="E|t*2|(t|)*1t,L"), 4, 2, 2) == [0, 2, 1, 1]
    for counts in ([3, 4, 4, 3], [0, 2, 2, 0], [2]):
        assert layers_per_stage(PipelineConfig(pipeline_model_parallel_layout=layout_string(counts)), sum(counts),
                                len(counts)) == counts


@pytest.mark.parametrize(("flags", "num_layers", "pp", "message"), [
    ({"pipeline_model_parallel_layout": "Et|tt|L"}, 4, 3, r"places 3 transformer layers, but the model has 4"),
    ({"pipeline_model_parallel_layout": "Et|tt|L"}, 3, 2, r"has 3 stages, but pp\*vpp = 2\*1 = 2"),
    ({"pipeline_model_parallel_layout": "tE|tt|L"}, 3, 3, r"the embedding E must come first"),
    ({"pipeline_model_parallel_layout": "Et|tx|L"}, 3, 3, r"stage 1 \('tx'\) has 'x'"),
    ({"pipeline_model_parallel_layout": "Et||tL"}, 2, 3, r"virtual stage\(s\) \[1\] without a transformer layer"),
    ({"decoder_first_pipeline_num_layers": 3, "decoder_last_pipeline_num_layers": 2}, 8, 4,
     r"the 3 layers left after .* do not split evenly over the 2 middle"),
    ({"decoder_first_pipeline_num_layers": 5, "decoder_last_pipeline_num_layers": 5}, 8, 2,
     r"= 10 layers on the first and last stages, but the model has 8"),
    ({"account_for_embedding_in_pipeline_split": True}, 8, 4, r"plus the embedding = 9 layers do not split evenly"),
])
def test_layouts_that_do_not_add_up_are_refused_naming_both_numbers(flags, num_layers, pp, message):
    with pytest.raises(PartitionError, match=message):
        layers_per_stage(PipelineConfig(**flags), num_layers, pp)


def test_flags_that_contradict_each_other_are_refused():
    with pytest.raises(ValueError, match="cannot be combined"):
        PipelineConfig(pipeline_model_parallel_layout="Et|tL", decoder_first_pipeline_num_layers=1)
    with pytest.raises(ValueError, match="cannot be combined"):
        PipelineConfig(decoder_last_pipeline_num_layers=1, account_for_loss_in_pipeline_split=True)


def test_search_candidates_add_up():
    for num_layers, pp, vpp in [(30, 4, 1), (32, 4, 1), (80, 8, 1), (16, 2, 2)]:
        for counts in uneven_candidates(num_layers, pp, vpp):
            assert sum(counts) == num_layers and len(counts) == pp * vpp and len(set(counts)) > 1
