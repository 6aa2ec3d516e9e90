"""Building the train/valid/test datasets from ``--data-path`` the way megatron-core does.

``--data-path p`` gives one dataset split by ``--split``; ``--data-path p1 p2`` blends them in
proportion to their sizes; ``--data-path w1 p1 w2 p2`` blends them by weight. Each contributing
dataset is asked for ``ceil(ceil(target * weight) * (1 + surplus))`` samples so the blend never
runs short, and the blend holds ``sum(ceil(target * weight))`` samples. ``blend_per_split``
gives each split its own data (``--train-data-path`` etc.).

Rank 0 builds (and caches) every index first; after a barrier the other ranks load them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from mega.data.blending import BlendedDataset, normalize
from mega.data.distributed import RankContext, current_rank_context
from mega.data.gpt_dataset import GPTDataset, GPTDatasetConfig, default_cache_directory
from mega.data.index_cache import IndexCache
from mega.data.indexed_dataset import IndexedDataset
from mega.data.mock_dataset import MockTokenSource
from mega.data.splits import SPLIT_NAMES, parse_split, split_bounds, split_documents
from mega.data.token_range import check_token_ids

Blend = tuple[list[str], "list[float] | None"]


def parse_data_path(words: Sequence[str]) -> Blend:
    """``["p1", "p2"]`` or ``["w1", "p1", "w2", "p2"]`` -> (prefixes, weights or None)."""
    words = [w.strip() for w in words]
    if not words:
        raise ValueError("--data-path is empty")
    if len(words) % 2 == 0:
        try:
            weights = [float(w) for w in words[0::2]]
        except ValueError:
            weights = None
        if weights is not None:
            if any(w <= 0 for w in weights):
                raise ValueError(f"--data-path weights must be positive, got {words[0::2]}")
            return words[1::2], weights
    numeric = [w for w in words if _is_number(w)]
    if numeric:
        raise ValueError(
            f"--data-path {' '.join(words)}: mixes weights ({', '.join(numeric)}) and paths; "
            f"give 'path ...' or 'weight path weight path ...'"
        )
    return words, None


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _size_per_dataset(weights: list[float], target_sizes: Sequence[int | None], surplus: float = 0.0):
    return [
        [None if size is None else int(math.ceil(math.ceil(size * w) * (1 + surplus))) for size in target_sizes]
        for w in weights
    ]


class SplitBuilder:
    """Builds the datasets of one kind: ``make(source, prefix, units, size, split_name, cache)``
    makes one split's dataset from the units (GPT: sequences; masked-LM: documents) that
    ``count_units(source)`` counts; ``surplus``: the extra share each blended dataset provides."""

    def __init__(self, make, count_units, surplus: float, cache_for_prefix,
                 vocabulary: tuple[int, str] | None = None):
        self.make, self.count_units, self.surplus = make, count_units, surplus
        self.cache_for_prefix = cache_for_prefix
        self.vocabulary = vocabulary
        self._sources: dict[str, IndexedDataset] = {}

    def source(self, prefix: str) -> IndexedDataset:
        if prefix not in self._sources:
            dataset = IndexedDataset(prefix)
            if self.vocabulary is not None:
                check_token_ids(dataset, *self.vocabulary, self.cache_for_prefix(prefix))
            self._sources[prefix] = dataset
        return self._sources[prefix]

    def splits_of(self, prefix: str, bounds, sizes) -> list:
        source = self.source(prefix)
        cache = self.cache_for_prefix(prefix)
        return [
            None if bound is None else self.make(
                source, prefix, split_documents(bound, self.count_units(source)), size, name, cache
            )
            for name, bound, size in zip(SPLIT_NAMES, bounds, sizes, strict=True)
        ]

    def blend(self, prefixes: list[str], weights: list[float] | None, bounds, sizes) -> list:
        if len(prefixes) == 1 and weights is None:
            return self.splits_of(prefixes[0], bounds, sizes)
        if weights is not None:
            weights = normalize(weights)
            targets = _size_per_dataset(weights, sizes)
            buffered = _size_per_dataset(weights, sizes, self.surplus)
        else:
            targets = buffered = [[None] * len(SPLIT_NAMES) for _ in prefixes]
        per_prefix = [self.splits_of(prefix, bounds, buffered[i]) for i, prefix in enumerate(prefixes)]
        cache = self.cache_for_prefix(prefixes[0])
        blends: list = []
        for split, name in enumerate(SPLIT_NAMES):
            if bounds[split] is None:
                blends.append(None)
                continue
            datasets = [splits[split] for splits in per_prefix]
            if weights is not None:
                if sizes[split] is None:
                    raise ValueError("weighted --data-path needs a sample count for every split it builds")
                blends.append(BlendedDataset(datasets, weights, sum(t[split] for t in targets), name, cache))
            else:
                lengths = [len(d) for d in datasets]
                size = None if sizes[split] is None else min(sizes[split], sum(lengths))
                blends.append(BlendedDataset(datasets, lengths, size, name, cache))
        return blends


def build_gpt_datasets(
    data_path: Sequence[str] | None,
    sizes: Sequence[int | None],
    config: GPTDatasetConfig,
    blend_per_split: Sequence[Sequence[str] | None] | None = None,
    rank_context: RankContext | None = None,
    vocabulary: tuple[int, str] | None = None,
) -> list:
    """[train, valid, test] datasets (``None`` for a split that gets no data).

    ``sizes`` are the sample counts per split (``None``: one epoch). Give ``data_path`` (with
    ``config.split``) or ``blend_per_split`` (three ``--data-path``-style lists or ``None``).
    ``vocabulary``: (size, description); every file's token ids must be below the size.
    """
    def cache_for_prefix(prefix: str) -> IndexCache | None:
        directory = default_cache_directory(prefix, config)
        return IndexCache(directory) if directory else None

    def make(source, prefix, sequences, size, name, cache):
        return GPTDataset(source, prefix, sequences, size, name, config, cache)

    builder = SplitBuilder(make, lambda source: len(source.sequence_lengths), config.mid_level_dataset_surplus,
                       cache_for_prefix, vocabulary)
    return build_split_datasets(builder, data_path, sizes, config.split, blend_per_split, rank_context)


def build_split_datasets(builder: SplitBuilder, data_path: Sequence[str] | None, sizes: Sequence[int | None],
                         split: str, blend_per_split: Sequence[Sequence[str] | None] | None = None,
                         rank_context: RankContext | None = None) -> list:
    """[train, valid, test] of ``builder``'s kind from ``--data-path`` and ``--split`` (or one
    blend per split), rank 0 first; see :func:`build_gpt_datasets`."""
    if (data_path is None) == (blend_per_split is None):
        raise ValueError("give either data_path (with a split) or blend_per_split")
    sizes = list(sizes) + [None] * (len(SPLIT_NAMES) - len(sizes))

    def build() -> list:
        if data_path is not None:
            prefixes, weights = parse_data_path(data_path)
            _check_prefixes(prefixes)
            return builder.blend(prefixes, weights, split_bounds(parse_split(split)), sizes)
        result = []
        for index, words in enumerate(blend_per_split):
            if words is None:
                result.append(None)
                continue
            prefixes, weights = parse_data_path(words)
            _check_prefixes(prefixes)
            bounds = [None] * len(SPLIT_NAMES)
            bounds[index] = (0.0, 1.0)
            split_sizes = [0] * len(SPLIT_NAMES)
            split_sizes[index] = sizes[index]
            result.append(builder.blend(prefixes, weights, bounds, split_sizes)[index])
        return result

    return _rank_zero_first(build, rank_context)


def build_mock_gpt_datasets(
    sizes: Sequence[int | None],
    config: GPTDatasetConfig,
    vocab_size: int,
    rank_context: RankContext | None = None,
) -> list:
    """Megatron's mock GPT data: synthetic documents, split by ``config.split``; nothing cached."""
    if config.eod is None:
        raise ValueError("mock data needs config.eod (the end-of-document id)")
    sizes = list(sizes) + [None] * (len(SPLIT_NAMES) - len(sizes))
    source = MockTokenSource(vocab_size, config.eod)
    bounds = split_bounds(parse_split(config.split))

    def build() -> list:
        return [
            None if bound is None else GPTDataset(
                source, None, split_documents(bound, len(source)), size, name, config, cache=None
            )
            for name, bound, size in zip(SPLIT_NAMES, bounds, sizes, strict=True)
        ]

    return build() if rank_context is None else _rank_zero_first(build, rank_context)


def _check_prefixes(prefixes: list[str]) -> None:
    for prefix in prefixes:
        for suffix in (".idx", ".bin"):
            if not os.path.isfile(prefix + suffix):
                hint = " (give the prefix, without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
                raise FileNotFoundError(f"--data-path {prefix}: {prefix + suffix} does not exist{hint}")


def _rank_zero_first(build, rank_context: RankContext | None):
    context = rank_context or current_rank_context()
    result = build() if context.rank == 0 else None
    context.barrier()
    return result if context.rank == 0 else build()
