"""The distributions install one by one and together, and each registers through its entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = {"mega-core", "mega-train", "mega-models", "mega-data", "mega-ckpt-convert", "mega-inference"}


def plugins_json(env=None, python_args=()):
    result = subprocess.run(
        [sys.executable, *python_args, "-m", "mega.core.cli.main", "plugins", "--json"],
        capture_output=True, text=True, env=env,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_every_distribution_of_the_repo_is_listed():
    listing = plugins_json()
    assert DISTRIBUTIONS <= {item["distribution"] for item in listing}
    assert all(item["error"] is None for item in listing), listing


def test_core_alone_lists_only_itself(tmp_path):
    # The core wheel plus pluggy, with no site-packages at all (-S): nothing else may be needed
    # to list plugins, and no sibling may be found.
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT / "packages" / "core"), "pluggy"],
        check=True,
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    listing = plugins_json(env, python_args=("-S",))
    assert [(item["name"], item["distribution"]) for item in listing] == [("core", "mega-core")]


def test_no_distribution_ships_a_mega_init():
    # `mega` is a PEP 420 namespace shared by every distribution.
    assert not list(ROOT.glob("packages/*/src/mega/__init__.py"))
    assert not list(ROOT.glob("plugins/*/src/mega/__init__.py"))
