"""The GPU suite and its wheelhouse, checked on the CPU (device: CPU only; nothing is measured).

* ``gpu_suite.py --dry-run`` parses every row's flags with the row's own script (mega train's
  parser included, for the training rows), so a renamed or removed flag fails here, not in the
  minutes a GPU is lent; a flag a script does not know makes the dry run fail.
* ``gpu_wheelhouse.sh --dry-run`` resolves, for the GPU machine's Python, what would be carried
  beyond its image: mega's packages are built and resolved, torch is not carried.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.py"


def test_every_row_of_the_gpu_suite_parses_on_the_cpu():
    done = subprocess.run([sys.executable, str(SUITE), "--dry-run"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "every row's flags parse" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert len(rows) >= 10  # training (mega, compiled, FP8, Hugging Face), decode and server rows


def test_the_dry_run_refuses_a_flag_mega_train_does_not_know():
    argv = ["--json", "--fp8-formatx", "hybrid"]
    done = subprocess.run([sys.executable, str(SUITE), "--check-script", "bench_gpu_mfu.py", json.dumps([argv])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "unknown flag --fp8-formatx" in done.stderr


def test_the_wheelhouse_resolves_without_torch():
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_wheelhouse.sh"), "--dry-run"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    carried = [line.split("==")[0].strip().lower() for line in done.stdout.splitlines() if "==" in line]
    assert "torchao" in carried and "fastapi" in carried
    assert "torch" not in carried and "triton" not in carried  # the GPU image has them
