"""Collective bandwidth the nccl-tests way: ``mega bench comm`` on 4 local ranks unless told otherwise.

    python benchmarks/bench_comm.py [mega bench comm options, e.g. -b 8 -e 128M -f 2 --json]

Without ``--nproc-per-node`` and outside torchrun it starts 4 local ranks (gloo on CPU, NCCL on
GPUs); see ``mega bench comm --help`` for every option.
"""

from __future__ import annotations

import os
import sys

from mega.train.bench.comm import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--nproc-per-node" not in argv and "RANK" not in os.environ and not {"-h", "--help"} & set(argv):
        argv = ["--nproc-per-node", "4", *argv]
    sys.exit(main(argv))
