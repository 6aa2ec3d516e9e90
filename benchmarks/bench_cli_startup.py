"""How long `mega` takes to start: plugin discovery must not import torch or other heavy libraries.

Compares `mega --help` and `mega plugins --json` against a bare `python -c pass` and against
`python -c "import torch"` (what a start-up that imports torch would cost at least).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "mega --help": [sys.executable, "-m", "mega.core.cli.main", "--help"],
    "mega plugins --json": [sys.executable, "-m", "mega.core.cli.main", "plugins", "--json"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
}


def median_seconds(command: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {name: median_seconds(command, args.repeats) for name, command in COMMANDS.items()}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    base = results["python -c pass"]
    print(f"{'command':<28} {'median s':>9} {'x python':>9}")
    for name, seconds in results.items():
        print(f"{name:<28} {seconds:>9.3f} {seconds / base:>9.1f}")


if __name__ == "__main__":
    main()
