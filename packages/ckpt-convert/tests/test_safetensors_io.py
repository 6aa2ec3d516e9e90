"""mega's streaming safetensors reader and writer agree with the safetensors library, produce
each tensor only when its bytes are due, and conversions read every tensor once."""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from mega.ckpt_convert.safetensors_io import (
    SafetensorsError,
    SafetensorsReader,
    TensorToWrite,
    write_safetensors,
)

TENSORS = {
    "f32": torch.randn(3, 5), "bf16": torch.randn(4, 2).to(torch.bfloat16), "f16": torch.randn(7).half(),
    "i64": torch.arange(6).reshape(2, 3), "bool": torch.tensor([True, False, True]), "u8": torch.arange(5, dtype=torch.uint8),
    "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
}


def to_write(tensors: dict) -> list[TensorToWrite]:
    return [TensorToWrite(name, tuple(t.shape), t.dtype, lambda t=t: t) for name, t in tensors.items()]


def test_written_files_load_with_the_library(tmp_path):
    write_safetensors(tmp_path / "mine.safetensors", to_write(TENSORS), metadata={"note": "x"})
    loaded = load_file(tmp_path / "mine.safetensors")
    assert set(loaded) == set(TENSORS)
    for name, tensor in TENSORS.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    header_size = struct.unpack("<Q", (tmp_path / "mine.safetensors").read_bytes()[:8])[0]
    assert header_size % 8 == 0


def test_library_files_read_one_tensor_at_a_time(tmp_path):
    save_file(TENSORS, tmp_path / "lib.safetensors", metadata={"format": "pt"})
    reader = SafetensorsReader(tmp_path / "lib.safetensors")
    try:
        assert reader.metadata == {"format": "pt"}
        for name, tensor in TENSORS.items():
            read = reader.read(name)
            assert read.dtype == tensor.dtype and torch.equal(read, tensor), name
    finally:
        reader.close()


def test_tensors_are_produced_only_when_written(tmp_path):
    events = []

    def produce(name):
        events.append(("produce", name))
        return torch.ones(4)

    tensors = [TensorToWrite(f"t{i}", (4,), torch.float32, lambda i=i: produce(f"t{i}")) for i in range(3)]
    write_safetensors(tmp_path / "lazy.safetensors", tensors, on_written=lambda t: events.append(("written", t.name)))
    assert events == [(event, f"t{i}") for i in range(3) for event in ("produce", "written")]
    with pytest.raises(ValueError, match="t0: produced torch.float32 \\[2\\], expected torch.float32 \\[3\\]"):
        write_safetensors(tmp_path / "bad.safetensors", [TensorToWrite("t0", (3,), torch.float32, lambda: torch.zeros(2))])


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[:5], "too short"),
    (lambda data: struct.pack("<Q", 10**12) + data[8:], "header length"),
    (lambda data: data[:8] + b"!" + data[9:], "the header is not JSON"),
    (lambda data: data[:-4], "truncated or corrupt"),
    (lambda data: data + b"\0" * 8, "8 bytes follow the last tensor"),
    (lambda data: data.replace(b'"data_offsets":[16,32]', b'"data_offsets":[20,36]') + b"\0" * 4,
     r"tensor 'b' at bytes \[20, 36\) leaves bytes \[16, 20\) unused"),
    (lambda data: data.replace(b'"data_offsets":[16,32]', b'"data_offsets":[12,28]'),
     r"tensor 'b' at bytes \[12, 28\) overlaps the tensor before it"),
])
def test_damaged_files_are_named(damage, message, tmp_path):
    """Every file rejected here the safetensors library rejects too."""
    path = tmp_path / "damaged.safetensors"
    save_file({"a": torch.ones(4), "b": torch.ones(4)}, path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(SafetensorsError, match=message) as error:
        SafetensorsReader(path)
    assert str(path) in str(error.value)
    with pytest.raises(Exception):  # noqa: B017 (the library raises its own kinds)
        load_file(path)


def test_conversions_read_each_tensor_once(hf_dirs, tmp_path, monkeypatch):
    """Memory stays at a layer: every source tensor is read once, when its map is converted."""
    pytest.importorskip("transformers")
    from mega.ckpt_convert import convert

    reads = []
    original = SafetensorsReader.read
    monkeypatch.setattr(SafetensorsReader, "read", lambda self, name: reads.append(name) or original(self, name))
    source = hf_dirs["llama-gqa-tied-bias"]
    stored = set(load_file(source / "model.safetensors"))
    for target in ("hf", "mega"):
        reads.clear()
        convert(source, tmp_path / target, to_format=target)
        assert sorted(reads) == sorted(stored), target
