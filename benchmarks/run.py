"""Run the benchmarks: every ``benchmarks/bench_*.py``, or the ones named (``python benchmarks/run.py comm``).

Each benchmark is a standalone script that prints its own table; this runner only picks and
runs them, in separate processes, and fails if any fails.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    available = {path.stem.removeprefix("bench_"): path for path in sorted(HERE.glob("bench_*.py"))}
    wanted = argv or list(available)
    unknown = [name for name in wanted if name not in available]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; available: {', '.join(available)}", file=sys.stderr)
        return 2
    failed = []
    for name in wanted:
        print(f"\n=== {name}: python {available[name].relative_to(HERE.parent)}", flush=True)
        if subprocess.run([sys.executable, str(available[name])]).returncode != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
