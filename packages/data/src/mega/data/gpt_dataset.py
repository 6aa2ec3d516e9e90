"""GPT training samples from token data, with megatron-core's ``GPTDataset`` semantics.

For the same data, split, seed, sequence length and sample count, ``GPTDataset`` here yields the
same samples in the same order as megatron-core's: the indices come from
:mod:`mega.data.sample_index`, and a sample is read the way Megatron reads it (``sequence_length
+ 1`` tokens across as many documents as it takes, padded at the very end of the data).

The indices are cached on disk (:class:`IndexCache`) and memory-mapped; which rank builds them is
decided by the builder in :mod:`mega.data.dataset_builder`.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from mega.data.blending import MID_LEVEL_SURPLUS
from mega.data.index_cache import IndexCache, description_hash, files_fingerprint
from mega.data.packing import document_ids_after_eod
from mega.data.sample_index import build_gpt_indices, epoch_plan

logger = logging.getLogger(__name__)

# Megatron's pad id when the tokenizer has none; never a real token id.
NO_PAD = -1
_INDEX_NAMES = ["document_index", "sample_index", "shuffle_index"]

# Mock data is never cached on disk (as in Megatron), yet its 100,000 documents make each split's
# indices up to a second of shuffling; a process that trains several times (tests, a notebook, the
# ranks of a test world) keeps the most recent ones, read-only, up to this size.
_MOCK_INDEX_MEMO_BYTES = 384 * 2**20
_mock_index_memo: OrderedDict[str, tuple[np.ndarray, ...]] = OrderedDict()


def _remembered_mock_indices(key: str, build) -> tuple[np.ndarray, ...]:
    if key in _mock_index_memo:
        _mock_index_memo.move_to_end(key)
        return _mock_index_memo[key]
    indices = build()
    for array in indices:
        array.flags.writeable = False
    size = sum(array.nbytes for array in indices)
    held = sum(array.nbytes for kept in _mock_index_memo.values() for array in kept)
    while _mock_index_memo and held + size > _MOCK_INDEX_MEMO_BYTES:
        held -= sum(array.nbytes for array in _mock_index_memo.popitem(last=False)[1])
    if size <= _MOCK_INDEX_MEMO_BYTES:
        _mock_index_memo[key] = indices
    return indices


@dataclass(frozen=True)
class GPTDatasetConfig:
    sequence_length: int
    random_seed: int = 1234
    split: str = "969,30,1"
    eod: int | None = None
    pad: int | None = None
    add_extra_token_to_sequence: bool = True
    drop_last_partial_validation_sequence: bool = True
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    path_to_cache: str | None = None
    mid_level_dataset_surplus: float = MID_LEVEL_SURPLUS

    def __post_init__(self):
        if self.sequence_length < 2:
            raise ValueError(f"sequence length must be at least 2, got {self.sequence_length}")
        if (self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss) and self.eod is None:
            raise ValueError("reset_position_ids, reset_attention_mask and eod_mask_loss need the eod id")


class GPTDataset:
    """Samples of one split of one token source (an :class:`IndexedDataset` or mock data)."""

    def __init__(
        self,
        source,
        path: str | None,
        documents: np.ndarray,
        num_samples: int | None,
        split: str,
        config: GPTDatasetConfig,
        cache: IndexCache | None = None,
    ):
        self.source = source
        self.path = path
        self.documents = documents
        self.num_samples = num_samples
        self.split = split
        self.config = config
        self.pad = NO_PAD if config.pad is None else config.pad
        self.description = json.dumps(
            {
                "class": "GPTDataset",
                "path": path,
                "files": files_fingerprint(path),
                "sequences": int(len(source.sequence_lengths)),
                "documents": [int(documents[0]), int(documents[-1]) + 1] if len(documents) else [0, 0],
                "num_samples": num_samples,
                "split": split,
                "random_seed": config.random_seed,
                "sequence_length": config.sequence_length,
                "add_extra_token_to_sequence": config.add_extra_token_to_sequence,
                "drop_last_partial_sequence": self._drop_last_partial_sequence,
            },
            indent=2,
        )
        self.stem = f"{description_hash(self.description)}-GPTDataset-{split}"
        if path is None and cache is None:
            indices = _remembered_mock_indices(self._mock_index_key(), lambda: self._indices(None))
        else:
            indices = self._indices(cache)
        self.document_index, self.sample_index, self.shuffle_index = indices

    @property
    def _drop_last_partial_sequence(self) -> bool:
        return self.config.drop_last_partial_validation_sequence if self.split == "valid" else True

    def _mock_index_key(self) -> str:
        """The description with the sample count replaced by all it changes (the epochs): runs of
        other lengths share one epoch's indices."""
        key = json.loads(self.description)
        tokens = int(np.sum(self.source.sequence_lengths[self.documents], dtype=np.int64))
        key["num_samples"] = epoch_plan(tokens, self.num_samples, self.config.sequence_length,
                                        int(self.config.add_extra_token_to_sequence)) if tokens else None
        return json.dumps(key)

    def _indices(self, cache: IndexCache | None):
        if cache is not None:
            cached = cache.load(self.stem, _INDEX_NAMES)
            if cached is not None:
                return tuple(cached[name] for name in _INDEX_NAMES)
        tokens = int(np.sum(self.source.sequence_lengths[self.documents], dtype=np.int64))
        if tokens == 0:
            raise ValueError(
                f"the {self.split} split of {self.path or 'the mock data'} has no tokens "
                f"({len(self.documents)} documents); change the split or the data"
            )
        indices = build_gpt_indices(
            self.source.sequence_lengths,
            self.documents,
            self.num_samples,
            self.config.sequence_length,
            self.config.random_seed,
            self._drop_last_partial_sequence,
            self.config.add_extra_token_to_sequence,
        )
        if cache is not None:
            try:
                cache.save(self.stem, self.description, dict(zip(_INDEX_NAMES, indices, strict=True)))
            except OSError as error:
                logger.warning("cannot cache the %s indices in %s: %s", self.split, cache.directory, error)
        return indices

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def sample_tokens(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``sequence_length + 1`` token ids of sample ``index`` (int64) and their document ids."""
        extra = int(self.config.add_extra_token_to_sequence)
        index = int(self.shuffle_index[index])
        first, first_offset = (int(v) for v in self.sample_index[index])
        last, last_offset = (int(v) for v in self.sample_index[index + 1])
        documents = [int(d) for d in self.document_index[first : last + 1]]
        if first == last:
            parts = [self.source.get(documents[0], first_offset, last_offset - first_offset + extra)]
        else:
            parts = [self.source.get(documents[0], first_offset)]
            parts += [self.source.get(d) for d in documents[1:-1]]
            parts.append(self.source.get(documents[-1], 0, last_offset + extra))
        missing = self.config.sequence_length + extra - sum(len(p) for p in parts)
        if missing > 0:  # only the last sample of a split kept with its partial sequence
            parts.append(np.full(missing, self.pad, dtype=np.int64))
        return np.concatenate(parts, dtype=np.int64), np.asarray(documents, dtype=np.int64)

    def __getitem__(self, index: int | None) -> dict[str, np.ndarray]:
        """tokens, labels, loss_mask and position_ids (and document_ids with reset_attention_mask).

        ``index=None`` gives a padding sample with a zero loss mask, as in Megatron.
        """
        text, _ = self.sample_tokens(0 if index is None else index)
        config = self.config
        if config.add_extra_token_to_sequence:
            tokens, labels = text[:-1].copy(), text[1:].copy()
        else:
            tokens, labels = text, np.roll(text, -1)
            labels[-1] = self.pad
        sample = _masks_and_positions(tokens, config)
        sample["loss_mask"][labels == self.pad] = 0.0
        tokens[tokens == self.pad] = 0
        labels[labels == self.pad] = 0
        if index is None:
            sample["loss_mask"][:] = 0.0
        sample["tokens"], sample["labels"] = tokens, labels
        return sample

    def __repr__(self) -> str:
        return f"GPTDataset({self.path!r}, split={self.split}, {len(self)} samples)"


def _masks_and_positions(tokens: np.ndarray, config: GPTDatasetConfig) -> dict[str, np.ndarray]:
    length = tokens.size
    loss_mask = np.ones(length, dtype=np.float32)
    if config.eod_mask_loss:
        loss_mask[tokens == config.eod] = 0.0
    position_ids = np.arange(length, dtype=np.int64)
    sample = {"loss_mask": loss_mask, "position_ids": position_ids}
    if config.reset_position_ids or config.reset_attention_mask:
        eods = np.nonzero(tokens == config.eod)[0]
        if config.reset_position_ids and eods.size:
            # Positions restart after every end-of-document token.
            restart = np.zeros(length, dtype=np.int64)
            restart[eods[eods + 1 < length] + 1] = eods[eods + 1 < length] + 1
            position_ids -= np.maximum.accumulate(restart)
        if config.reset_attention_mask:
            # Megatron's dense [1, s, s] mask, as the documents each token belongs to (an EOD ends
            # its document): the model keeps them apart (mega.core.kernels.AttentionMask cu_seqlens).
            sample["document_ids"] = document_ids_after_eod(tokens, config.eod)
    return sample


def default_cache_directory(prefix: str | None, config: GPTDatasetConfig) -> str | None:
    if config.path_to_cache:
        return config.path_to_cache
    if prefix is None:
        return None
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", "GPTDataset_indices")


__all__ = ["GPTDataset", "GPTDatasetConfig", "NO_PAD"]
