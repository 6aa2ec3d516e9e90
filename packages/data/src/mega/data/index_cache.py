"""On-disk cache of dataset indices, shared by all ranks of a job.

An entry is named by the md5 of a JSON description of everything the indices depend on, so a
changed seed, split or sample count can never pick up stale files; nor can a dataset replaced
under the same prefix, since the description holds its files' sizes and modification times. Arrays are written to
temporary names and renamed; the description file is renamed last and marks the entry complete.
Readers memory-map the arrays, so all ranks of a node share one copy in the page cache.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import numpy as np


def description_hash(description: str) -> str:
    return hashlib.md5(description.encode("utf-8"), usedforsecurity=False).hexdigest()


def files_fingerprint(prefix: str | None) -> dict[str, list[int]] | None:
    """Size and modification time (ns) of a dataset's ``.bin`` and ``.idx``: a dataset rewritten
    under the same prefix, even with as many documents, gets a new cache entry."""
    if prefix is None:
        return None
    fingerprint = {}
    for suffix in (".bin", ".idx"):
        stat = os.stat(prefix + suffix)
        fingerprint[suffix] = [stat.st_size, stat.st_mtime_ns]
    return fingerprint


class IndexCache:
    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)

    def _path(self, stem: str, name: str) -> str:
        return os.path.join(self.directory, f"{stem}-{name}")

    def load(self, stem: str, names: list[str]) -> dict[str, np.ndarray] | None:
        """The arrays of a complete entry, memory-mapped; ``None`` when there is none."""
        if not os.path.isfile(self._path(stem, "description.txt")):
            return None
        paths = {name: self._path(stem, f"{name}.npy") for name in names}
        if not all(os.path.isfile(p) for p in paths.values()):
            return None
        return {name: np.load(path, mmap_mode="r", allow_pickle=False) for name, path in paths.items()}

    def save(self, stem: str, description: str, arrays: dict[str, np.ndarray]) -> None:
        os.makedirs(self.directory, exist_ok=True)
        for name, array in arrays.items():
            self._atomic_write(self._path(stem, f"{name}.npy"), lambda stream, a=array: np.save(stream, a, allow_pickle=False))
        self._atomic_write(self._path(stem, "description.txt"), lambda stream: stream.write(description.encode("utf-8")))

    def _atomic_write(self, path: str, write) -> None:
        handle, temporary = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=os.path.basename(path))
        try:
            with os.fdopen(handle, "wb") as stream:
                write(stream)
            os.replace(temporary, path)
        except BaseException:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise
