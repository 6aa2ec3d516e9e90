"""GPT samples and blends against megatron-core's GPTDataset and BlendedDataset."""

from __future__ import annotations

import numpy as np
import pytest

from mega.data.blending import build_blending_indices, normalize
from mega.data.dataset_builder import build_gpt_datasets, build_mock_gpt_datasets, parse_data_path
from mega.data.distributed import RankContext
from mega.data.gpt_dataset import GPTDatasetConfig
from mega.data.sample_index import build_sample_index

pytest.importorskip("megatron.core.datasets.gpt_dataset")
from megatron.core.datasets import helpers as megatron_helpers  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MegatronGPTDatasetConfig  # noqa: E402
from megatron.core.datasets.gpt_dataset import MockGPTDataset  # noqa: E402
from megatron.core.datasets.utils import get_blend_from_list  # noqa: E402
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer  # noqa: E402

EOD = 50000
# megatron-core loops forever on a split without tokens; a mistake here must fail, not hang.
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, megatron_dataset_writer, make_documents):
    """Three datasets written by megatron-core: varied lengths, some empty documents."""
    directory = tmp_path_factory.mktemp("gpt")
    sizes = [(0, 2000, 120), (1, 300, 300), (2, 200, 50)]
    return [
        megatron_dataset_writer(directory / f"corpus{seed}", make_documents(seed, count, EOD, length, zero_length_every=17))
        for seed, count, length in sizes
    ]


def megatron_datasets(data_path, sizes, tmp_path, mock=False, **options):
    config = MegatronGPTDatasetConfig(
        random_seed=options.get("seed", 1234),
        sequence_length=options["sequence_length"],
        blend=None if mock else get_blend_from_list(data_path),
        split=options.get("split", "80,10,10"),
        path_to_cache=None,  # (with a cache directory, its BlendedDataset insists on torch.distributed)
        tokenizer=NullTokenizer(EOD),
        reset_position_ids=options.get("reset_position_ids", False),
        reset_attention_mask=options.get("reset_attention_mask", False),
        eod_mask_loss=options.get("eod_mask_loss", False),
        add_extra_token_to_sequence=options.get("extra", True),
        drop_last_partial_validation_sequence=options.get("drop_last_valid", True),
        mid_level_dataset_surplus=0.005,
    )
    cls = MockGPTDataset if mock else MegatronGPTDataset
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


def mega_config(tmp_path, **options):
    return GPTDatasetConfig(
        sequence_length=options["sequence_length"],
        random_seed=options.get("seed", 1234),
        split=options.get("split", "80,10,10"),
        eod=EOD,
        add_extra_token_to_sequence=options.get("extra", True),
        drop_last_partial_validation_sequence=options.get("drop_last_valid", True),
        reset_position_ids=options.get("reset_position_ids", False),
        reset_attention_mask=options.get("reset_attention_mask", False),
        eod_mask_loss=options.get("eod_mask_loss", False),
        path_to_cache=str(tmp_path / "mega_cache"),
    )


def assert_same_samples(ours, theirs, every: int = 1):
    assert (ours is None) == (theirs is None)
    if ours is None:
        return
    assert len(ours) == len(theirs)
    # Every sample of small datasets; the first few thousand and the very last of big ones.
    for i in [*range(0, min(len(ours), 3000), every), *range(max(0, len(ours) - 3), len(ours))]:
        if hasattr(theirs, "dataset_index"):
            dataset, sample = theirs.dataset_index[i], theirs.dataset_sample_index[i]
            expected, _ = theirs.datasets[dataset]._query_document_sample_shuffle_indices(sample)
        else:
            expected, _ = theirs._query_document_sample_shuffle_indices(i)
        got, _ = ours.sample_tokens(i)
        np.testing.assert_array_equal(got, expected, err_msg=f"sample {i}")


CASES = [
    # split, seed, sequence length, sample counts, extra token, drop last partial validation
    ("969,30,1", 1234, 16, [500, 40, 8], True, True),
    ("80,10,10", 7, 64, [2800, 330, 340], True, True),  # two epochs, the last one kept in the shuffle
    ("100,0,0", 3, 33, [2000, None, None], True, True),
    ("1,1,1", 99, 8, [2300, 50, 5], False, True),  # no extra token
    ("90,10", 5, 100, [None, None, None], True, False),  # one epoch, partial validation sample kept
    ("70,20,10", 11, 7, [13000, 7000, 10], True, False),  # last epochs shuffled separately
]


@pytest.mark.parametrize("split, seed, sequence_length, sizes, extra, drop_last_valid", CASES)
def test_single_dataset_samples_equal_megatron(corpora, tmp_path, split, seed, sequence_length, sizes, extra, drop_last_valid):
    options = dict(split=split, seed=seed, sequence_length=sequence_length, extra=extra, drop_last_valid=drop_last_valid)
    theirs = megatron_datasets([corpora[0]], sizes, tmp_path, **options)
    ours = build_gpt_datasets([corpora[0]], sizes, mega_config(tmp_path, **options))
    for our_split, their_split in zip(ours, theirs, strict=True):
        assert_same_samples(our_split, their_split)
        if our_split is not None:
            np.testing.assert_array_equal(our_split.document_index, their_split.document_index)
            np.testing.assert_array_equal(our_split.sample_index, their_split.sample_index)
            np.testing.assert_array_equal(our_split.shuffle_index, their_split.shuffle_index)
            assert our_split.shuffle_index.dtype == their_split.shuffle_index.dtype


def test_separate_final_epoch_is_exercised(corpora):
    """The cases above cover both sides of Megatron's 80% rule for the last epoch."""
    from mega.data.indexed_dataset import IndexedDataset
    from mega.data.sample_index import num_epochs_needed, separate_final_epoch

    lengths = IndexedDataset(corpora[0]).sequence_lengths
    seen = set()
    for split, _, sequence_length, sizes, extra, _ in CASES:
        from mega.data.splits import parse_split, split_bounds, split_documents

        bounds = split_bounds(parse_split(split))
        for bound, size in zip(bounds, sizes, strict=True):
            if bound is None or size is None:
                continue
            tokens = int(lengths[split_documents(bound, len(lengths))].sum())
            epochs = num_epochs_needed(tokens, size, sequence_length, int(extra))
            if epochs > 1:
                seen.add(separate_final_epoch(epochs, tokens, size, sequence_length, int(extra))[0])
    assert seen == {True, False}


def test_getitem_matches_megatron_masks_and_positions(corpora, tmp_path):
    options = dict(sequence_length=32, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    theirs = megatron_datasets([corpora[2]], [300, 20, 20], tmp_path, **options)[0]
    ours = build_gpt_datasets([corpora[2]], [300, 20, 20], mega_config(tmp_path, **options))[0]
    for i in list(range(0, len(ours), 13)) + [None]:
        expected = theirs[i]
        got = ours[i]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            np.testing.assert_array_equal(got[key], expected[key].numpy(), err_msg=f"{key} of sample {i}")
        # Megatron's dense mask (True: not attended) is causal attention within our documents.
        documents = got["document_ids"]
        allowed = np.tril(documents[:, None] == documents[None, :])
        np.testing.assert_array_equal(~allowed, expected["attention_mask"].numpy()[0], err_msg=f"sample {i}")


@pytest.mark.parametrize(
    "data_path, sizes",
    [
        (["30", "{0}", "50", "{1}", "20", "{2}"], [700, 60, 20]),
        (["0.9", "{1}", "0.1", "{2}"], [1500, 100, 30]),
        (["{0}", "{1}", "{2}"], [400, 40, 20]),  # weights from the datasets' sizes
        (["{0}", "{2}"], [None, None, None]),  # exhaustive: every sample of every dataset once
    ],
)
def test_blended_samples_equal_megatron(corpora, tmp_path, data_path, sizes):
    data_path = [word.format(*corpora) for word in data_path]
    theirs = megatron_datasets(data_path, sizes, tmp_path, sequence_length=24, split="90,8,2")
    ours = build_gpt_datasets(data_path, sizes, mega_config(tmp_path, sequence_length=24, split="90,8,2"))
    for our_split, their_split in zip(ours, theirs, strict=True):
        assert_same_samples(our_split, their_split, every=3)
        np.testing.assert_array_equal(our_split.dataset_index, their_split.dataset_index)
        np.testing.assert_array_equal(our_split.dataset_sample_index, their_split.dataset_sample_index)


def test_blend_per_split_equals_megatron(corpora, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder as Builder,
    )

    per_split = [["2", corpora[0], "1", corpora[1]], [corpora[2]], None]
    config = MegatronGPTDatasetConfig(
        random_seed=5, sequence_length=20, blend_per_split=[get_blend_from_list(p) if p else None for p in per_split],
        path_to_cache=None, tokenizer=NullTokenizer(EOD), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False,
    )
    theirs = Builder(MegatronGPTDataset, [900, 50, None], lambda: True, config).build()
    ours = build_gpt_datasets(None, [900, 50, None], mega_config(tmp_path, sequence_length=20, seed=5), blend_per_split=per_split)
    for our_split, their_split in zip(ours, theirs, strict=True):
        assert_same_samples(our_split, their_split, every=2)


def test_mock_data_equals_megatron(tmp_path):
    theirs = megatron_datasets(None, [300, 30, 10], tmp_path, mock=True, sequence_length=128, split="1,1,1")
    config = GPTDatasetConfig(sequence_length=128, split="1,1,1", eod=EOD)
    ours = build_mock_gpt_datasets([300, 30, 10], config, vocab_size=EOD + 1)
    for our_split, their_split in zip(ours, theirs, strict=True):
        assert_same_samples(our_split, their_split)


def test_mock_indices_are_remembered_only_where_they_are_the_same(tmp_path):
    """A process keeps mock indices: other sample counts within one epoch reuse them (and still
    equal megatron-core's samples), a count that needs another epoch does not."""
    config = GPTDatasetConfig(sequence_length=128, split="1,1,1", eod=EOD)
    first = build_mock_gpt_datasets([300, 30, 10], config, vocab_size=EOD + 1)
    same_epoch = build_mock_gpt_datasets([250, 20, 5], config, vocab_size=EOD + 1)
    assert all(a.shuffle_index is b.shuffle_index for a, b in zip(first, same_epoch, strict=True))
    assert not same_epoch[0].shuffle_index.flags.writeable
    theirs = megatron_datasets(None, [250, 20, 5], tmp_path, mock=True, sequence_length=128, split="1,1,1")
    for our_split, their_split in zip(same_epoch, theirs, strict=True):
        assert_same_samples(our_split, their_split)
    two_epochs = len(first[2]) + 1
    other = build_mock_gpt_datasets([300, 30, two_epochs], config, vocab_size=EOD + 1)
    assert other[2].shuffle_index is not first[2].shuffle_index and len(other[2]) > len(first[2])


def test_sample_index_equals_megatron_helper_with_empty_documents():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 50, 3000).astype(np.int32)
    lengths[::7] = 0
    for extra in (True, False):
        for drop_last in (True, False):
            for sequence_length in (2, 5, 64, 1000):
                document_index = rng.permutation(np.tile(np.arange(3000, dtype=np.int32), 2))
                tokens = int(lengths.sum())
                expected = megatron_helpers.build_sample_idx(lengths, document_index, sequence_length, 2, tokens, drop_last, extra)
                got = build_sample_index(lengths, document_index, sequence_length, 2, tokens, drop_last, extra)
                np.testing.assert_array_equal(got, expected)
                assert got.dtype == expected.dtype


@pytest.mark.parametrize("datasets", [1, 2, 3, 7, 40])
def test_blending_indices_equal_megatron_helper(datasets):
    rng = np.random.default_rng(datasets)
    for size in (1, 2, 1000, 123_457):
        weights = normalize(rng.random(datasets) ** 3 + 1e-4)
        expected_index = np.zeros(size, np.int16)
        expected_sample = np.zeros(size, np.int64)
        megatron_helpers.build_blending_indices(expected_index, expected_sample, np.array(weights), datasets, size, False)
        got_index, got_sample = build_blending_indices(weights, size)
        np.testing.assert_array_equal(got_index, expected_index)
        np.testing.assert_array_equal(got_sample, expected_sample)


@pytest.mark.parametrize("datasets", [4, 12])  # both ways of choosing (per-dataset compare, argmax)
def test_blending_indices_at_scale_take_one_pass(monkeypatch, datasets):
    """Thousands of blocks: exact, and the burn-in makes every block's start right the first time."""
    import mega.data.blending as blending

    calls = []
    simulate = blending._simulate
    monkeypatch.setattr(blending, "_simulate", lambda *args: calls.append(len(args[1])) or simulate(*args))
    size = 2_000_000
    weights = normalize(np.arange(1, datasets + 1) ** 1.5)
    expected_index, expected_sample = np.zeros(size, np.int16), np.zeros(size, np.int64)
    megatron_helpers.build_blending_indices(expected_index, expected_sample, np.array(weights), datasets, size, False)
    got_index, got_sample = build_blending_indices(weights, size)
    np.testing.assert_array_equal(got_index, expected_index)
    np.testing.assert_array_equal(got_sample, expected_sample)
    assert len(calls) == 2 and calls[0] > 3000  # the burn-in and the one pass, over all blocks


def test_exhaustive_blending_equals_megatron_helper():
    rng = np.random.default_rng(3)
    for datasets in (1, 2, 5):
        counts = rng.integers(1, 20_000, datasets)
        total = int(counts.sum())
        expected_index, expected_sample = np.zeros(total, np.int16), np.zeros(total, np.int64)
        megatron_helpers.build_exhaustive_blending_indices(expected_index, expected_sample, counts, datasets)
        got_index, got_sample = build_blending_indices([int(c) / float(total) for c in counts], total, counts)
        np.testing.assert_array_equal(got_index, expected_index)
        np.testing.assert_array_equal(got_sample, expected_sample)


def test_indices_are_cached_and_memory_mapped(corpora, tmp_path):
    config = mega_config(tmp_path, sequence_length=16)
    first = build_gpt_datasets([corpora[1]], [100, 10, 1], config)[0]
    cached = sorted(p.name for p in (tmp_path / "mega_cache").iterdir())
    assert any(name.endswith("-GPTDataset-train-sample_index.npy") for name in cached)
    again = build_gpt_datasets([corpora[1]], [100, 10, 1], config)[0]
    assert isinstance(again.sample_index, np.memmap)
    np.testing.assert_array_equal(again.sample_index, first.sample_index)
    # A different seed is a different cache entry, never a stale hit.
    other = build_gpt_datasets([corpora[1]], [100, 10, 1], mega_config(tmp_path, sequence_length=16, seed=1))[0]
    assert not np.array_equal(other.shuffle_index, first.shuffle_index)


def test_a_dataset_replaced_under_the_same_prefix_is_not_served_from_the_cache(
        tmp_path, megatron_dataset_writer, make_documents):
    # Same prefix, same number of documents, other lengths: the cache once served the old indices
    # ("all input arrays must have the same shape", "tokens 67:4 out of range").
    prefix = tmp_path / "corpus"
    config = mega_config(tmp_path, sequence_length=16)
    megatron_dataset_writer(prefix, make_documents(0, 300, EOD, 40))
    build_gpt_datasets([str(prefix)], [100, 10, 1], config)
    megatron_dataset_writer(prefix, make_documents(1, 300, EOD, 90))
    replaced = build_gpt_datasets([str(prefix)], [100, 10, 1], config)[0]
    fresh = build_gpt_datasets([str(prefix)], [100, 10, 1], mega_config(tmp_path / "fresh", sequence_length=16))[0]
    np.testing.assert_array_equal(replaced.sample_index, fresh.sample_index)
    for i in range(0, len(fresh), 7):
        np.testing.assert_array_equal(replaced[i]["tokens"], fresh[i]["tokens"])


def test_rank_zero_builds_before_the_others(corpora, tmp_path):
    events = []
    config = mega_config(tmp_path, sequence_length=16)

    class Recorder(RankContext):
        pass

    build_gpt_datasets([corpora[2]], [50, 5, 1], config, rank_context=Recorder(1, lambda: events.append("barrier")))
    assert events == ["barrier"]
    # Rank 1 built after the barrier; with rank 0's cache present it only loads.
    rank0 = build_gpt_datasets([corpora[2]], [50, 5, 1], config, rank_context=RankContext(0, lambda: events.append("barrier0")))
    assert events[-1] == "barrier0" and isinstance(rank0[0].sample_index, np.memmap)


def test_data_path_parsing_and_errors(tmp_path):
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_data_path(["a"]) == (["a"], None)
    with pytest.raises(ValueError, match="mixes weights"):
        parse_data_path(["0.3", "a", "b"])
    with pytest.raises(FileNotFoundError, match=r"does not exist \(give the prefix"):
        build_gpt_datasets([str(tmp_path / "x.bin")], [1, 1, 1], GPTDatasetConfig(sequence_length=8))
    with pytest.raises(ValueError, match="sequence length"):
        GPTDatasetConfig(sequence_length=1)
