"""The weight files of a Hugging Face model directory: ``model.safetensors``, or shards named by
``model.safetensors.index.json``; read a tensor at a time, written a tensor at a time."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.safetensors_io import (
    SafetensorsError,
    SafetensorsReader,
    TensorToWrite,
    write_safetensors,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


class HFWeights:
    """Every tensor of a directory's safetensors files, by name; files stay open until ``close``."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._readers: dict[str, SafetensorsReader] = {}
        self._where: dict[str, SafetensorsReader] = {}
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        index_path, single = self.directory / INDEX_FILE, self.directory / SINGLE_FILE
        if index_path.is_file():
            weight_map = _read_weight_map(index_path)
            for file_name in sorted(set(weight_map.values())):
                self._readers[file_name] = self._reader(file_name, index_path)
            for name, file_name in weight_map.items():
                reader = self._readers[file_name]
                if name not in reader.tensors:
                    raise ConversionError(f"{index_path} places {name} in {file_name}, which does not hold it")
                self._where[name] = reader
            for file_name, reader in self._readers.items():
                unlisted = sorted(set(reader.tensors) - set(weight_map))
                if unlisted:
                    raise ConversionError(f"{self.directory / file_name} holds {', '.join(unlisted[:3])}, which "
                                          f"{INDEX_FILE} does not list; the index and the shards disagree")
        elif single.is_file():
            reader = self._readers[SINGLE_FILE] = self._reader(SINGLE_FILE, None)
            self._where = dict.fromkeys(reader.tensors, reader)
        elif any((self.directory / name).exists() for name in PICKLE_FILES):
            raise ConversionError(f"{self.directory} holds pytorch_model.bin (a pickle), which mega does not load; "
                                  "re-save it as safetensors (transformers: save_pretrained(safe_serialization=True))")
        else:
            raise ConversionError(f"{self.directory} has no {SINGLE_FILE} nor {INDEX_FILE}")

    def _reader(self, file_name: str, index_path: Path | None) -> SafetensorsReader:
        path = self.directory / file_name
        if not path.is_file():
            raise ConversionError(f"{index_path} names {file_name}, which is missing from {self.directory}")
        try:
            return SafetensorsReader(path)
        except SafetensorsError as error:
            raise ConversionError(str(error)) from None

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].tensors[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._where[name].tensors[name].dtype

    def file(self, name: str) -> Path:
        return self._where[name].path

    def read(self, name: str) -> torch.Tensor:
        try:
            return self._where[name].read(name)
        except SafetensorsError as error:
            raise ConversionError(str(error)) from None

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()


def _read_weight_map(index_path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
        raise ConversionError(f"{index_path} is not a safetensors index with a weight_map ({error!r})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ConversionError(f"{index_path}: weight_map must map tensor names to file names")
    return weight_map


def write_hf_weights(directory: Path, tensors: list[TensorToWrite], max_shard_bytes: int,
                     on_written: Callable[[TensorToWrite], None] | None = None) -> None:
    """``model.safetensors``, or shards of at most ``max_shard_bytes`` (a larger tensor gets a
    shard of its own) with ``model.safetensors.index.json``, as ``save_pretrained`` lays them out."""
    shards: list[list[TensorToWrite]] = [[]]
    shard_bytes = 0
    for tensor in tensors:
        if shards[-1] and shard_bytes + tensor.nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(tensor)
        shard_bytes += tensor.nbytes
    if len(shards) == 1:
        write_safetensors(directory / SINGLE_FILE, shards[0], on_written=on_written)
        return
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(directory / file_name, shard, on_written=on_written)
        weight_map.update(dict.fromkeys((tensor.name for tensor in shard), file_name))
    index = {"metadata": {"total_size": sum(tensor.nbytes for tensor in tensors)}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
