"""The run's tokenizer and datasets, from the registered plugins."""

from __future__ import annotations

import dataclasses

from mega.core.checkpoint.saved_model import saved_model
from mega.core.config import ConfigError
from mega.core.datasets import DatasetRequest, TrainingData
from mega.core.plugins import Plugins
from mega.core.tokenizer import TokenizerOptions, TokenizerSpec
from mega.train.run_config import Derived, RunConfig


def tokenizer_spec(run: RunConfig) -> TokenizerSpec | None:
    data = run.data
    if data.tokenizer_type is None:
        return None
    return TokenizerSpec(data.tokenizer_type, TokenizerOptions(
        vocab_file=data.vocab_file, merge_file=data.merge_file, tokenizer_model=data.tokenizer_model,
        vocab_size=run.model.vocab_size, vocab_extra_ids=data.vocab_extra_ids,
    ))


def dataset_name(run: RunConfig, plugins: Plugins) -> str:
    """``--dataset``, else the family's builder for ``--mock-data`` or ``--data-path`` (GPT's
    samples and mock samples for decoder families; an encoder or encoder-decoder family names its own)."""
    if run.data.dataset:
        return run.data.dataset
    if run.data.sft:
        return "sft"
    from_files, mock = plugins.models.get(run.training.model_family).datasets
    if run.data.mock_data:
        return mock
    if run.data.data_path:
        return from_files
    raise ConfigError("no training data: give --data-path PREFIX (see `mega preprocess`) or --mock-data")


def sample_counts(run: RunConfig, derived: Derived) -> tuple[int, int, int]:
    """Samples each split must provide (Megatron's arithmetic)."""
    training, batch = run.training, derived.global_batch_size
    evaluations = training.train_iters // training.eval_interval + 1
    return (training.train_iters * batch, evaluations * training.eval_iters * batch, training.eval_iters * batch)


def run_tokenizer(run: RunConfig, plugins: Plugins):
    """The run (its vocabulary now the tokenizer's), its tokenizer and the tokenizer's spec (both
    None without --tokenizer-type). Also used by runs that read no dataset (mega rl)."""
    spec = tokenizer_spec(run)
    tokenizer = spec.build(plugins) if spec else None
    if tokenizer is not None:
        run = _with_vocab_size(run, vocabulary_size(run, tokenizer.vocab_size, plugins))
    return run, tokenizer, spec


def build_datasets(run: RunConfig, derived: Derived, plugins: Plugins) -> tuple[RunConfig, TrainingData]:
    """The run (its vocabulary now the tokenizer's) and its train/valid/test data."""
    run, tokenizer, spec = run_tokenizer(run, plugins)
    builder = plugins.datasets.get(dataset_name(run, plugins))
    data = builder(DatasetRequest(
        data_path=run.data.data_path, split=run.data.split, seq_length=run.model.seq_length,
        seed=run.training.seed, num_samples=sample_counts(run, derived), cache_path=run.data.data_cache_path,
        tokenizer=tokenizer, vocab_size=run.model.vocab_size, model=run.model,
        mask_prob=run.data.mask_prob, short_seq_prob=run.data.short_seq_prob,
        packed_sequences=run.data.packed_sequences, pad_documents_to=packed_document_multiple(run),
        reset_position_ids=run.data.reset_position_ids,
        reset_attention_mask=run.data.reset_attention_mask, eod_mask_loss=run.data.eod_mask_loss,
    ))
    if data.tokenizer is not None and tokenizer is None:
        run = _with_vocab_size(run, data.tokenizer.vocab_size)
    elif tokenizer is not None:
        data.tokenizer, data.tokenizer_spec = tokenizer, spec
    return run, data


def packed_document_multiple(run: RunConfig) -> int:
    """What each packed document's length is rounded up to: under context parallelism, which cuts
    every document into ``2 x cp`` equal chunks, ``2 x cp`` (as Megatron pads packed SFT data)."""
    cp = run.parallel.cp
    return 2 * cp if run.data.packed_sequences and cp > 1 else 1


def vocabulary_size(run: RunConfig, tokenizer_size: int, plugins: Plugins) -> int:
    """The model's vocabulary: the tokenizer's, except in a run that loads its model from a
    checkpoint, whose embedding may hold more rows than its tokenizer has ids (Hugging Face models
    round it up: Qwen3's 151936 rows for 151669 ids); the tokenizer's ids must fit in it."""
    if tokenizer_size <= run.model.vocab_size and saved_model(run.checkpoint.load, plugins) is not None:
        return run.model.vocab_size
    return tokenizer_size


def _with_vocab_size(run: RunConfig, vocab_size: int) -> RunConfig:
    return dataclasses.replace(run, model=dataclasses.replace(run.model, vocab_size=vocab_size))
