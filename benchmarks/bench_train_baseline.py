"""The seeds' baseline report: ``mega bench train`` on the tiny GPT unless told otherwise.

    python benchmarks/bench_train_baseline.py [mega bench train / mega train flags]

With no arguments: ``--model-preset tiny --mock-data``, micro-batch 4, 8 iterations (2 warm-up),
every precision; the report goes to ``bench-train.md`` / ``.json`` in the working directory.
On a GPU machine pass a real size, e.g. ``--model-preset 1.3b --micro-batch-size 4 --seq-length 2048``.
"""

from __future__ import annotations

import sys

from mega.train.bench.train import main

DEFAULT = ["--model-preset", "tiny", "--mock-data", "--micro-batch-size", "4", "--train-iters", "8",
           "--eval-iters", "0", "--log-interval", "100", "--hidden-dropout", "0", "--attention-dropout", "0"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or DEFAULT))
