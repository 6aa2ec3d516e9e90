"""One writer per save directory: the run that saves into ``DIR`` holds ``DIR/.mega-save.lock``.

Two runs saving into one directory would stage into the same ``.tmp-iter_N``, delete each other's
work and publish checkpoints mixed from both. The lock is an exclusive ``flock`` on the lock file,
held for the life of the run; the file names its holder (pid, host, start time) so the second run
can say who is in the way. The operating system drops the lock when its holder dies however it
dies (even SIGKILL), so a lock file left by a dead run is simply taken over. On NFS, Linux maps
``flock`` to byte-range locks, which the NFS lock manager shares between hosts.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
import weakref
from pathlib import Path

from mega.core.checkpoint.metadata import CheckpointError

LOCK_FILE = ".mega-save.lock"


class SaveDirLock:
    """Holds the lock of ``save_dir`` from construction until :meth:`release` (or this process ends)."""

    def __init__(self, save_dir: str | os.PathLike):
        self.path = Path(save_dir) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = self._lock_current_file()
        self.previous_holder = _holder_text(os.pread(self._fd, 4096, 0))  # a run that ended, or None
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(holder).encode(), 0)
        # Closing the descriptor drops the lock: do it when this object goes, if release() was not called.
        self._closer = weakref.finalize(self, os.close, self._fd)

    def _lock_current_file(self) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder_text(os.pread(fd, 4096, 0)) or "a process that has not named itself yet"
                os.close(fd)
                raise CheckpointError(
                    f"{self.path.parent} is in use by another run ({holder}): two runs saving into one "
                    f"directory would destroy each other's checkpoints. Give this run another --save "
                    f"directory, or stop the other one (lock file {self.path})") from None
            # The holder may have released (and removed) the file between our open and our lock:
            # then we hold a lock on a file nobody else will look at, and must try the new one.
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def release(self) -> None:
        if self._closer.alive:
            self.path.unlink(missing_ok=True)  # before the close, so a waiter on this file retries
            self._closer()


def _holder_text(raw: bytes) -> str | None:
    try:
        holder = json.loads(raw.decode())
        return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return None
