"""CPU, gloo. The README's script runs with mega-core alone installed (torch, pluggy and numpy beside
it, no other mega package): at tp 2 x pp 2 on four ranks it prints the losses one process prints."""

from __future__ import annotations

import os
import re
import runpy
import socket
import subprocess
import sys
from pathlib import Path

import numpy
import pluggy
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def readme_script() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("<!-- tp_pipeline.py -->\n```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture(scope="module")
def core_alone(tmp_path_factory) -> dict:
    """The environment of the core wheel and its dependencies' folders only (run with -S: no
    site-packages, so no editable mega package is found)."""
    target = tmp_path_factory.mktemp("core-alone")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True)
    beside = {str(Path(module.__file__).resolve().parents[1]) for module in (torch, numpy, pluggy)}
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), *sorted(beside)]), OMP_NUM_THREADS="1")


def losses(output: str) -> list[list[float]]:
    """The loss lists printed (rounded to 5 decimals by the script)."""
    return [[float(value) for value in found.split(", ")] for found in re.findall(r"losses \[(.*)\]", output)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_readme_script_runs_with_the_core_alone_and_matches_one_process(core_alone, tmp_path, monkeypatch,
                                                                          capsys):
    script = tmp_path / "tp_pipeline.py"
    script.write_text(readme_script())
    monkeypatch.setenv("TP_PP", "1,1")  # one process: this one (torch is imported already)
    runpy.run_path(str(script), run_name="__main__")
    (expected,) = losses(capsys.readouterr().out)
    world = dict(core_alone, TP_PP="2,2", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ranks = [subprocess.Popen([sys.executable, "-S", str(script)], env=dict(world, RANK=str(rank), LOCAL_RANK=str(rank)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(4)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0] * 4, [err[-2000:] for _, err in outputs]
    printed = "".join(out for out, _ in outputs)
    assert len(losses(printed)) == 2  # the last stage's two tensor-parallel ranks
    for got in losses(printed):
        assert got == pytest.approx(expected, abs=2e-5)
