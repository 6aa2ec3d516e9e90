"""CPU. The templates `mega plugins new` fills are real files ruff lints, and every kind fills into
Python with no placeholder left (tests/test_plugin_contract.py installs each kind and runs its test)."""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib import resources

import pytest

from mega.train.scaffold.command import files_for
from mega.train.scaffold.templates import KINDS, PLACEHOLDER

TEMPLATES = resources.files("mega.train.scaffold") / "plugin_templates"


def test_the_template_files_pass_ruff():
    python_files = sorted(str(path) for path in _python_files(TEMPLATES))
    assert len(python_files) >= 2 * len(KINDS)  # a package and a test per kind
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *python_files],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_fills_into_python_with_no_placeholder_left(kind):
    files = files_for("loss-csv", kind)
    assert {"pyproject.toml", "README.md", "loss_csv/__init__.py", "tests/test_loss_csv.py"} <= set(files)
    for path, text in files.items():
        assert not PLACEHOLDER.search(text), f"{kind} {path}: {PLACEHOLDER.search(text).group(0)} left"
        if path.endswith(".py"):
            ast.parse(text, filename=path)
    assert 'name = "loss-csv"' in files["pyproject.toml"] and 'loss_csv = "loss_csv"' in files["pyproject.toml"]


def _python_files(directory):
    for entry in directory.iterdir():
        if entry.is_dir():
            yield from _python_files(entry)
        elif entry.name.endswith(".py"):
            yield entry
