"""The distributions install one by one and together, and each registers through its entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mega.core.cli.elsewhere import PACKAGES

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = {"mega-core", "mega-train", "mega-models", "mega-data", "mega-ckpt-convert", "mega-inference",
                 "mega-rl"}


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


@pytest.fixture(scope="module")
def core_alone(tmp_path_factory):
    """The environment of the core wheel plus pluggy alone (run with -S: no site-packages at all)."""
    target = tmp_path_factory.mktemp("core-alone") / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT / "packages" / "core"), "pluggy"],
        check=True,
    )
    return dict(os.environ, PYTHONPATH=str(target))


def mega(env, *argv, python_args=()):
    return subprocess.run([sys.executable, *python_args, "-m", "mega.core.cli.main", *argv],
                          capture_output=True, text=True, env=env)


def test_core_alone_lists_only_itself(core_alone):
    # Nothing else may be needed to list plugins, and no sibling may be found.
    env = core_alone
    listing = plugins_json(env, python_args=("-S",))
    assert [(item["name"], item["distribution"]) for item in listing] == [("core", "mega-core")]


def test_no_distribution_ships_a_mega_init():
    # `mega` is a PEP 420 namespace shared by every distribution.
    assert not list(ROOT.glob("packages/*/src/mega/__init__.py"))
    assert not list(ROOT.glob("plugins/*/src/mega/__init__.py"))


def test_core_alone_lists_what_it_has_and_names_the_package_of_a_missing_command(core_alone):
    listed = mega(core_alone, "--help", python_args=("-S",))
    assert listed.returncode == 0, listed.stderr
    commands = listed.stdout.split("commands:\n")[1].split("\n\n")[0].split("\n")
    assert [line.split()[0] for line in commands] == ["plugins"]
    assert "mega-train: train, plan, doctor, bench, checkpoint, plugins new" in listed.stdout
    for argv, command in ((["train", "--train-iters", "3"], "train"), (["plugins", "new", "x", "--kind", "command"],
                                                                      "plugins new"), (["bench", "comm"], "bench")):
        refused = mega(core_alone, *argv, python_args=("-S",))
        assert refused.returncode == 2
        assert refused.stderr == (f"mega: `mega {command}` comes with mega-train, which is not installed: install "
                                  "mega-train (pip install -c constraints.txt -e packages/train, from the mega "
                                  "repository)\n")
    assert "mega-data, which is not installed" in mega(core_alone, "preprocess", python_args=("-S",)).stderr


def test_a_disabled_package_is_named_as_disabled():
    refused = mega(dict(os.environ, MEGA_DISABLE_PLUGINS="train"), "plan", "--help")
    assert refused.returncode == 2
    assert "`mega plan` comes with mega-train, whose plugin train is disabled here" in refused.stderr


def test_the_table_of_missing_commands_is_what_each_package_registers():
    registered = {}
    for item in plugins_json():
        for name in item["registered"].get("command", []):
            registered.setdefault(item["distribution"], set()).add(name)
    for distribution, (path, commands) in PACKAGES.items():
        assert (ROOT / path / "pyproject.toml").is_file()
        names = registered[distribution]
        for command in commands:  # each is a command of the package, or a group of its commands
            assert any(name == command or name.startswith(command + " ") for name in names), (distribution, command)
        for name in names:  # and the table misses none of them
            assert any(name == command or name.startswith(command + " ") for command in commands), (distribution, name)


def test_each_package_readme_opens_with_what_it_is_for_and_what_it_may_import():
    readmes = sorted(ROOT.glob("packages/*/README.md")) + sorted(ROOT.glob("plugins/*/README.md"))
    assert len(readmes) == len(list(ROOT.glob("packages/*/pyproject.toml")) + list(ROOT.glob("plugins/*/pyproject.toml")))
    for readme in readmes:
        title, blank, purpose, imports = readme.read_text().splitlines()[:4]
        assert title.startswith("# mega-") and blank == "", readme
        assert purpose.startswith("- **For:** ") and imports.startswith("- **May import:** "), readme
