"""T5's config flags (the encoder length under both of Megatron's names) and its pipeline stages:
where the encoder and the decoder layers go, what each stage reads and sends, bad splits."""

from __future__ import annotations

import pytest
import torch

from mega.core.parallel import ParallelConfig
from mega.core.pipeline.partition import PartitionError
from mega.models.config import ModelConfigError
from mega.models.t5.family import FAMILY


def test_encoder_seq_length_is_seq_length_and_presets_match_google_sizes():
    from mega.train.command import parse_run

    run, _ = parse_run(["--model-family", "t5", "--model-preset", "tiny", "--mock-data", "--encoder-seq-length", "48",
                        "--decoder-seq-length", "12"])
    assert (run.model.seq_length, run.model.decoder_seq_length, run.model.encoder_seq_length) == (48, 12, None)
    # Hugging Face's parameter counts of t5-small / t5-base / t5-large / google/t5-v1_1-base.
    counts = {"small": 60_506_624, "base": 222_903_552, "large": 737_668_096, "v1_1-base": 247_577_856}
    for preset, count in counts.items():
        assert FAMILY.num_parameters(FAMILY.preset(preset)) == count, preset
    with pytest.raises(ModelConfigError, match="--feed-forward-proj"):
        FAMILY.preset("tiny", feed_forward_proj="swiglu")
    with pytest.raises(ModelConfigError, match="--num-attention-heads 4 is not divisible"):
        FAMILY.preset("tiny").validate(3)


def layers(stages):
    return [(list(s.layers["encoder"]), list(s.layers["decoder"])) for s in stages]


def test_stages_split_encoder_then_decoder():
    config = FAMILY.preset("tiny", num_layers=2, decoder_num_layers=2)
    assert layers(FAMILY.pipeline_stages(config, 2)) == [([0, 1], []), ([], [0, 1])]
    assert layers(FAMILY.pipeline_stages(config, 4)) == [([0], []), ([1], []), ([], [0]), ([], [1])]
    uneven = FAMILY.preset("tiny", num_layers=4, decoder_num_layers=2, pipeline_model_parallel_split_rank=2)
    assert layers(FAMILY.pipeline_stages(uneven, 3)) == [([0, 1], []), ([2, 3], []), ([], [0, 1])]
    mixed = FAMILY.preset("tiny", num_layers=3, decoder_num_layers=1)
    stages = FAMILY.pipeline_stages(mixed, 2)
    assert layers(stages) == [([0, 1], []), ([2], [0])]
    assert stages[0].batch_keys == ("text_enc", "text_dec", "enc_mask", "dec_mask")
    assert stages[1].batch_keys == ("enc_mask", "dec_mask")
    with pytest.raises(PartitionError, match="split-rank 2 must be between 1 and pipeline size - 1 = 1"):
        FAMILY.pipeline_stages(FAMILY.preset("tiny", pipeline_model_parallel_split_rank=2), 2)
    with pytest.raises(PartitionError, match="no interleaved pipeline schedule"):
        FAMILY.pipeline_stages(config, 2, 2)


def test_boundary_carries_what_the_next_stage_needs():
    config = FAMILY.preset("tiny", num_layers=2, decoder_num_layers=2, seq_length=16, decoder_seq_length=8)
    stages = FAMILY.pipeline_stages(config, 4)
    parallel = ParallelConfig(tp=2, pp=4, sequence_parallel=True)

    def shapes(index):
        return {name: spec.shape for name, spec in FAMILY.boundary(config, stages[index], 3, parallel,
                                                                   torch.float32).items()}
    assert shapes(0) == {"encoder_hidden": (8, 3, 64), "encoder_bias": (1, 2, 16, 16), "decoder_hidden": (4, 3, 64)}
    assert shapes(1) == {"encoder_output": (8, 3, 64), "decoder_hidden": (4, 3, 64)}
    assert shapes(2) == {"encoder_output": (8, 3, 64), "decoder_hidden": (4, 3, 64), "decoder_bias": (1, 2, 8, 8)}
