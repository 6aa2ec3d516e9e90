"""Splitting a sequence of layers into pipeline stages and model chunks."""

from __future__ import annotations

import pytest
from torch import nn

from mega.core.parallel import ParallelConfig, ParallelGroups
from mega.core.pipeline import PartitionError, pipeline_chunks, split_layers


def test_even_split_gives_consecutive_blocks():
    assert split_layers(8, pp=4) == [[range(0, 2)], [range(2, 4)], [range(4, 6)], [range(6, 8)]]


def test_interleaved_chunk_c_of_rank_r_holds_block_c_times_pp_plus_r():
    split = split_layers(8, pp=2, vpp=2)
    assert split == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    split = split_layers(24, pp=4, vpp=3)
    for rank in range(4):
        for chunk in range(3):
            block = chunk * 4 + rank
            assert split[rank][chunk] == range(2 * block, 2 * block + 2)


def test_uneven_split_with_explicit_counts_in_pipeline_order():
    assert split_layers(7, pp=3, layers_per_stage=[2, 3, 2]) == [[range(0, 2)], [range(2, 5)], [range(5, 7)]]
    # Virtual stages in pipeline order: rank 0 chunk 0, rank 1 chunk 0, rank 0 chunk 1, ...
    assert split_layers(6, pp=2, vpp=2, layers_per_stage=[1, 2, 2, 1]) == [
        [range(0, 1), range(3, 5)],
        [range(1, 3), range(5, 6)],
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 4, 1, None), r"cannot split 10 layers evenly into pp\*vpp = 4\*1 = 4 stages.*e\.g\. \[3, 3, 2, 2\]"),
        ((3, 2, 2, None), r"cannot split 3 layers into pp\*vpp = 2\*2 = 4 stages: every stage needs at least one"),
        ((6, 2, 1, [2, 2, 2]), r"has 3 counts, but pp\*vpp = 2\*1 = 2 stages"),
        ((6, 2, 1, [1, 4]), r"adds up to 5 layers, but the model has 6"),
        ((6, 3, 1, [3, 0, 3]), r"every stage but the first and the last needs at least one layer; layers_per_stage = \[3, 0, 3\]"),
    ],
)
def test_impossible_splits_say_why(args, message):
    num_layers, pp, vpp, counts = args
    with pytest.raises(PartitionError, match=message):
        split_layers(num_layers, pp, vpp, counts)


def test_single_process_chunk_keeps_the_full_models_parameter_names():
    layers = [nn.Linear(4, 4) for _ in range(3)]
    (chunk,) = pipeline_chunks(layers, ParallelGroups(ParallelConfig()))
    assert dict(chunk.named_parameters()).keys() == dict(nn.Sequential(*layers).named_parameters()).keys()
