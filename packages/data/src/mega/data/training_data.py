"""The dataset builders `mega train` uses (mega.core.datasets contract): GPT samples and mock data.

``gpt``: Megatron's GPTDataset over ``--data-path`` (one prefix split by ``--split``, or a
blend). ``mock``: Megatron's synthetic documents, for tests and benchmarks without a dataset.
"""

from __future__ import annotations

from mega.core.datasets import DatasetRequest, TrainingData
from mega.data.dataset_builder import build_gpt_datasets, build_mock_gpt_datasets
from mega.data.gpt_dataset import GPTDatasetConfig


def _config(request: DatasetRequest, eod: int | None, pad: int | None) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        sequence_length=request.seq_length, random_seed=request.seed, split=request.split,
        eod=eod, pad=pad, path_to_cache=request.cache_path,
    )


def gpt_datasets(request: DatasetRequest) -> TrainingData:
    if not request.data_path:
        raise ValueError("the gpt dataset needs --data-path (prefixes of .bin/.idx files from `mega preprocess`)")
    tokenizer = request.tokenizer
    eod = tokenizer.eod if tokenizer is not None else None
    pad = getattr(tokenizer, "pad", None) if tokenizer is not None else None
    vocabulary = (f"the vocabulary of {type(tokenizer).__name__}" if tokenizer is not None
                  else f"--vocab-size {request.vocab_size}")
    # A request that leaves the size to the tokenizer (0) is bounded by the tokenizer's.
    size = request.vocab_size or (tokenizer.vocab_size if tokenizer is not None else 0)
    splits = build_gpt_datasets(request.data_path, request.num_samples, _config(request, eod, pad),
                                vocabulary=(size, vocabulary))
    return TrainingData(*splits)


def mock_datasets(request: DatasetRequest) -> TrainingData:
    # Without a tokenizer the last id of the vocabulary ends documents, as for Megatron's NullTokenizer.
    eod = request.tokenizer.eod if request.tokenizer is not None else request.vocab_size - 1
    splits = build_mock_gpt_datasets(request.num_samples, _config(request, eod, None), request.vocab_size)
    return TrainingData(*splits)
