"""A checksum per checkpoint file, recorded at save and compared on load.

A file's size says whether it is all there; only its contents say whether it is intact (a few
kilobytes overwritten or a flipped bit keep the size and load without error, as NaNs or silently
changed weights). CRC-32 (zlib) is used because it is fast enough to read a checkpoint at disk
speed (about 1.4 GB/s on one core) and it detects every burst of errors up to 32 bits long,
which covers the damage storage does; it is no defence against deliberate tampering.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from mega.core.checkpoint.metadata import CheckpointError, CheckpointMetadata

ALGORITHM = "crc32"
_CHUNK = 8 << 20  # read in 8 MiB blocks: memory stays flat whatever the file's size


def file_checksum(path: Path) -> str:
    """``"crc32:xxxxxxxx"`` of a file's bytes."""
    value = 0
    with open(path, "rb") as stream:
        while block := stream.read(_CHUNK):
            value = zlib.crc32(block, value)
    return f"{ALGORITHM}:{value:08x}"


def record_checksums(directory: Path, metadata: CheckpointMetadata) -> None:
    """Fill ``metadata.checksums`` for every file ``metadata.files`` lists."""
    metadata.checksums = {name: file_checksum(directory / name) for name in metadata.files}


def verify_checksums(directory: Path, metadata: CheckpointMetadata) -> None:
    """Raise :class:`CheckpointError` naming the first file whose contents changed since the save.

    Checkpoints written before checksums were recorded have none; their files are not checked.
    """
    for name, expected in sorted(metadata.checksums.items()):
        if not expected.startswith(ALGORITHM + ":"):
            raise CheckpointError(f"{directory}/{name}: unknown checksum {expected!r} (this mega knows {ALGORITHM})")
        actual = file_checksum(directory / name)
        if actual != expected:
            raise CheckpointError(f"checkpoint {directory} is damaged: {name} has checksum {actual}, expected "
                                  f"{expected} (its contents changed after the save; restore it from a copy, "
                                  f"or --load an older checkpoint)")
