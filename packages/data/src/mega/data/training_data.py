"""The dataset builders `mega train` uses (mega.core.datasets contract).

``gpt``: Megatron's GPTDataset over ``--data-path`` (one prefix split by ``--split``, or a
blend). ``mock``: Megatron's synthetic documents, for tests and benchmarks without a dataset.
``bert`` / ``t5``: megatron-core's masked WordPiece samples over sentence-split data (with the
run's WordPiece tokenizer); ``bert-mock`` / ``t5-mock``: the same samples over synthetic
sentences (:mod:`mega.data.mock_sentences`).
"""

from __future__ import annotations

import os

from mega.core.datasets import DatasetRequest, TrainingData
from mega.data.blending import MID_LEVEL_SURPLUS
from mega.data.dataset_builder import (
    SplitBuilder,
    build_gpt_datasets,
    build_mock_gpt_datasets,
    build_split_datasets,
)
from mega.data.gpt_dataset import GPTDatasetConfig
from mega.data.index_cache import IndexCache
from mega.data.masked_datasets import BERTDataset, MaskedDatasetConfig, MaskedVocabulary, T5Dataset
from mega.data.mock_sentences import MockSentenceSource, mock_vocabulary
from mega.data.splits import SPLIT_NAMES, parse_split, split_bounds, split_documents


def _config(request: DatasetRequest, eod: int | None, pad: int | None) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        sequence_length=request.seq_length, random_seed=request.seed, split=request.split,
        eod=eod, pad=pad, path_to_cache=request.cache_path, reset_position_ids=request.reset_position_ids,
        reset_attention_mask=request.reset_attention_mask, eod_mask_loss=request.eod_mask_loss,
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


def _masked_config(request: DatasetRequest, cache_path: str | None = None) -> MaskedDatasetConfig:
    model = request.model
    return MaskedDatasetConfig(
        sequence_length=request.seq_length, random_seed=request.seed, masking_probability=request.mask_prob,
        short_sequence_probability=request.short_seq_prob, binary_head=getattr(model, "bert_binary_head", True),
        decoder_sequence_length=getattr(model, "decoder_seq_length", None), path_to_cache=cache_path,
    )


def _masked_datasets(request: DatasetRequest, dataset_class) -> TrainingData:
    if not request.data_path:
        raise ValueError(f"the {dataset_class.kind} data needs --data-path (sentence-split .bin/.idx files: "
                         f"`mega preprocess --split-sentences`)")
    if request.tokenizer is None:
        raise ValueError("masked-LM data needs its WordPiece tokenizer: --tokenizer-type BertWordPieceLowerCase "
                         "--vocab-file vocab.txt")
    vocabulary = MaskedVocabulary.of(request.tokenizer)
    config = _masked_config(request, request.cache_path)

    def cache_for_prefix(prefix: str) -> IndexCache:
        directory = config.path_to_cache or os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache",
                                                         f"{dataset_class.kind}_indices")
        return IndexCache(directory)

    def make(source, prefix, documents, size, name, cache):
        return dataset_class(source, prefix, documents, size, name, config, vocabulary, cache)

    size = request.vocab_size or request.tokenizer.vocab_size
    builder = SplitBuilder(make, lambda source: len(source.document_indices) - 1, MID_LEVEL_SURPLUS,
                       cache_for_prefix, (size, f"the vocabulary of {type(request.tokenizer).__name__}"))
    return TrainingData(*build_split_datasets(builder, request.data_path, request.num_samples, request.split))


def _mock_masked_datasets(request: DatasetRequest, dataset_class) -> TrainingData:
    vocabulary = mock_vocabulary(request.vocab_size)
    source = MockSentenceSource(vocabulary)
    config = _masked_config(request)
    bounds = split_bounds(parse_split(request.split))
    return TrainingData(*[
        None if bound is None else dataset_class(
            source, None, split_documents(bound, MockSentenceSource.documents), size, name, config, vocabulary)
        for name, bound, size in zip(SPLIT_NAMES, bounds, request.num_samples, strict=True)
    ])


def bert_datasets(request: DatasetRequest) -> TrainingData:
    return _masked_datasets(request, BERTDataset)


def bert_mock_datasets(request: DatasetRequest) -> TrainingData:
    return _mock_masked_datasets(request, BERTDataset)


def t5_datasets(request: DatasetRequest) -> TrainingData:
    return _masked_datasets(request, T5Dataset)


def t5_mock_datasets(request: DatasetRequest) -> TrainingData:
    return _mock_masked_datasets(request, T5Dataset)
