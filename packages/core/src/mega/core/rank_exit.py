"""How a rank of a job ends: it notes its failure for the launcher, and a finished rank exits
without the interpreter's teardown of torch's distributed state.

The note (:func:`record_failure`) lets a launcher (mega-train's ``launch_local``) tell the rank that
failed first, say with a clear configuration error, from the peers whose collectives then broke.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

# Each local rank may record its failure here (the launcher sets it, one file per rank).
FAILURE_FILE_ENV = "MEGA_FAILURE_FILE"


def record_failure(exit_code: int) -> None:
    """Note, for the launcher (mega-train's ``launch_local``), that this rank is failing now (the first note wins)."""
    path = os.environ.get(FAILURE_FILE_ENV)
    if not path or os.path.exists(path):
        return
    with open(path + ".part", "w") as out:
        json.dump({"time": time.time(), "exit_code": exit_code}, out)
    os.replace(path + ".part", path)


def end_rank_process(exit_code: int) -> None:
    """End a rank of a distributed job now, with ``exit_code``, skipping interpreter shutdown.

    After the process group is destroyed, the interpreter's shutdown still tears down torch's C++
    state (gloo/NCCL contexts and their threads, the store's client) in whatever order the
    garbage falls; now and then a thread is still joinable when its owner is destroyed, and the
    C++ runtime aborts the finished run ("terminate called without an active exception", exit
    250 or 134). Everything this process had to do is done and flushed, so it exits without that
    teardown.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
            pass
    logging.shutdown()
    os._exit(exit_code)
