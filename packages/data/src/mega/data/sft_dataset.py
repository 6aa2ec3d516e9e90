"""Supervised fine-tuning samples (``mega train --sft``) from ``mega preprocess --chat`` datasets.

Each conversation is one document of the token dataset, with its assistant mask in the
``_loss_mask`` dataset beside it. A row of ``--seq-length`` tokens holds one conversation, or with
``--packed-sequences`` as many as :func:`first_fit_decreasing` fits, each followed directly by
the next and the rest padded. Within a conversation token ``t`` predicts token ``t + 1``; the
loss counts it where token ``t + 1`` is the assistant's, never across two conversations or into
the padding. A packed row also carries ``document_ids``, and its positions restart at every
conversation, so a packed conversation computes what it computes alone. Under context
parallelism every packed conversation is padded to a multiple of ``2 x cp`` tokens (``pad_to``:
context parallelism cuts each into ``2 x cp`` equal chunks); the padding follows the
conversation within its document, out of the loss, and no token of the conversation sees it.

The bins (one epoch) and the order rows are read in (each further epoch shuffled anew from the
seed) are cached beside the data like GPT's indices (:class:`IndexCache`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import numpy as np

from mega.core.datasets import TrainingData
from mega.data.blending import MID_LEVEL_SURPLUS
from mega.data.chat_encoder import LOSS_MASK_SUFFIX
from mega.data.dataset_builder import SplitBuilder, build_split_datasets
from mega.data.index_cache import IndexCache, description_hash, files_fingerprint
from mega.data.indexed_dataset import IndexedDataset
from mega.data.packing import first_fit_decreasing, positions_within_documents

logger = logging.getLogger(__name__)
_INDEX_NAMES = ["bin_documents", "bin_offsets", "sample_bins"]


@dataclass(frozen=True)
class SFTDatasetConfig:
    sequence_length: int
    random_seed: int = 1234
    split: str = "969,30,1"
    packed: bool = False
    pad: int = 0  # the id padding positions hold (they are out of the loss)
    pad_to: int = 1  # packed: each conversation's length rounded up to a multiple of this
    path_to_cache: str | None = None


class SFTDataset:
    def __init__(self, tokens: IndexedDataset, path: str, documents: np.ndarray, num_samples: int | None,
                 split: str, config: SFTDatasetConfig, cache: IndexCache | None = None):
        self.tokens, self.path, self.documents, self.config = tokens, path, documents, config
        self.masks = open_loss_masks(tokens, path)
        self.split = split
        self.description = json.dumps({
            "class": "SFTDataset", "path": path, "files": files_fingerprint(path),
            "documents": [int(documents[0]), int(documents[-1]) + 1] if len(documents) else [0, 0],
            "num_samples": num_samples, "split": split, "random_seed": config.random_seed,
            "sequence_length": config.sequence_length, "packed": config.packed, "packing": "first-fit-decreasing",
            **({"pad_to": config.pad_to} if config.packed and config.pad_to > 1 else {}),
        }, indent=2)
        stem = f"{description_hash(self.description)}-SFTDataset-{split}"
        cached = cache.load(stem, _INDEX_NAMES) if cache is not None else None
        if cached is None:
            cached = dict(zip(_INDEX_NAMES, self._build_indices(num_samples), strict=True))
            if cache is not None:
                try:
                    cache.save(stem, self.description, cached)
                except OSError as error:
                    logger.warning("cannot cache the %s packing in %s: %s", split, cache.directory, error)
        self.bin_documents, self.bin_offsets, self.sample_bins = (cached[name] for name in _INDEX_NAMES)

    def _build_indices(self, num_samples: int | None):
        lengths = self.tokens.sequence_lengths[self.documents].astype(np.int64)
        limit = self.config.sequence_length
        too_long = np.flatnonzero(lengths > limit)
        if too_long.size:
            first = int(too_long[0])
            raise ValueError(
                f"{self.path}: conversation {int(self.documents[first])} has {int(lengths[first])} tokens, more than "
                f"--seq-length {limit} ({too_long.size} such; `mega preprocess --chat --seq-length {limit}` names "
                f"their lines)")
        if not len(lengths):
            raise ValueError(f"the {self.split} split of {self.path} has no conversations; change --split")
        if self.config.packed:
            items, offsets = first_fit_decreasing(self._padded(lengths), limit)
        else:
            items, offsets = np.arange(len(lengths), dtype=np.int64), np.arange(len(lengths) + 1, dtype=np.int64)
        bins = len(offsets) - 1
        epochs = 1 if num_samples is None else max(1, -(-num_samples // bins))
        generator = np.random.RandomState(self.config.random_seed)
        order = np.concatenate([generator.permutation(bins) for _ in range(epochs)])
        if num_samples is not None:
            order = order[:num_samples]
        return self.documents[items].astype(np.int64), offsets, order.astype(np.int64)

    def _padded(self, lengths):
        """Packed conversations' lengths rounded up to a multiple of ``pad_to`` (--seq-length is one:
        a conversation that fits still fits)."""
        pad_to = self.config.pad_to if self.config.packed else 1
        return -(-lengths // pad_to) * pad_to

    def __len__(self) -> int:
        return len(self.sample_bins)

    def __getitem__(self, index: int | None) -> dict[str, np.ndarray]:
        """tokens, labels, loss_mask, position_ids (and document_ids when packed); ``None``: a
        row with nothing in the loss."""
        sample_bin = int(self.sample_bins[0 if index is None else index])
        documents = self.bin_documents[self.bin_offsets[sample_bin]:self.bin_offsets[sample_bin + 1]]
        length = self.config.sequence_length
        tokens = np.full(length, self.config.pad, dtype=np.int64)
        labels = np.zeros(length, dtype=np.int64)
        loss_mask = np.zeros(length, dtype=np.float32)
        document_ids = np.full(length, len(documents), dtype=np.int64)  # the padding: one more document
        start = 0
        for number, document in enumerate(documents.tolist()):
            ids, mask = self.tokens[document].astype(np.int64), self.masks[document]
            end = start + len(ids)
            tokens[start:end] = ids
            labels[start:end - 1] = ids[1:]
            loss_mask[start:end - 1] = mask[1:]  # a label counts where the assistant wrote it
            end = start + int(self._padded(len(ids)))  # the padding after it, its document's, out of the loss
            document_ids[start:end] = number
            start = end
        if index is None:
            loss_mask[:] = 0.0
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
        if self.config.packed:
            sample["position_ids"] = positions_within_documents(document_ids)
            sample["document_ids"] = document_ids
        else:
            sample["position_ids"] = np.arange(length, dtype=np.int64)
        return sample

    def __repr__(self) -> str:
        return f"SFTDataset({self.path!r}, split={self.split}, {len(self)} rows, packed={self.config.packed})"


def open_loss_masks(tokens: IndexedDataset, path: str) -> IndexedDataset:
    """The ``_loss_mask`` dataset beside a chat dataset, checked to match it document for document."""
    mask_prefix = path + LOSS_MASK_SUFFIX
    try:
        masks = IndexedDataset(mask_prefix)
    except (OSError, ValueError) as error:
        raise ValueError(f"--sft: {path} has no loss mask beside it ({error}); preprocess the data with "
                         f"`mega preprocess --chat`") from None
    if not np.array_equal(masks.sequence_lengths, tokens.sequence_lengths):
        raise ValueError(f"--sft: {mask_prefix} does not match {path} document for document")
    return masks


def sft_datasets(request):
    """The ``sft`` dataset builder (``mega train --sft``): train/valid/test over ``--data-path``
    (chat datasets, blends too) split by ``--split``."""
    if not request.data_path:
        raise ValueError("--sft needs --data-path (the prefix of `mega preprocess --chat` output, "
                         "e.g. data/chat_messages_document)")
    tokenizer = request.tokenizer
    pad = getattr(tokenizer, "pad", None) if tokenizer is not None else None
    config = SFTDatasetConfig(sequence_length=request.seq_length, random_seed=request.seed, split=request.split,
                              packed=request.packed_sequences, pad=pad if pad is not None else 0,
                              pad_to=request.pad_documents_to,
                              path_to_cache=request.cache_path)

    def cache_for_prefix(prefix: str) -> IndexCache:
        return IndexCache(config.path_to_cache or os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache",
                                                               "SFTDataset_indices"))

    def make(source, prefix, documents, size, name, cache):
        if not len(documents) and name != "train" and len(request.data_path) == 1:
            # Fine-tuning files are small: --split's default leaves a few conversations no test
            # split (mega train evaluates none) or no validation split, which matters only when
            # the run evaluates it.
            if name == "valid" and size:
                raise ValueError(empty_split_message(name, prefix, len(source.sequence_lengths), request.split))
            return None
        return SFTDataset(source, prefix, documents, size, name, config, cache)

    size = request.vocab_size or (tokenizer.vocab_size if tokenizer is not None else 0)
    vocabulary = (size, f"the vocabulary of {type(tokenizer).__name__}" if tokenizer is not None
                  else f"--vocab-size {size}") if size else None
    builder = SplitBuilder(make, lambda source: len(source.sequence_lengths), MID_LEVEL_SURPLUS, cache_for_prefix,
                           vocabulary)
    return TrainingData(*build_split_datasets(builder, request.data_path, request.num_samples, request.split))


def empty_split_message(name: str, prefix: str, documents: int, split: str) -> str:
    """Why the ``name`` split that an evaluation reads is empty, and a ``--split`` that fills it."""
    held_out = max(1, -(-documents // 20))  # 5%, at least one conversation
    works = f"--split {documents - held_out},{held_out},0" if documents > held_out else "a file with more conversations"
    return (f"the {name} split of {prefix} has no conversations: the file has {documents} and --split {split} gives "
            f"the {name} split none of them, but the run evaluates it (--eval-iters); give {works} "
            f"({held_out} conversation(s) to validate on), or --eval-iters 0")
