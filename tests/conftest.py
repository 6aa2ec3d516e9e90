"""Fixtures of the repository-level tests: third-party plugins installed outside the tree."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="session")
def install_plugins(tmp_path_factory):
    """``install_plugins(*sources) -> environ``: pip-install the distributions at ``sources`` (as a
    user would, built from their pyproject) into a fresh directory outside the tree, and return
    an environment whose Python sees them beside the installed mega. One call per test module:
    building costs a few seconds per call."""

    def install(*sources) -> dict[str, str]:
        target = tmp_path_factory.mktemp("site")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), *map(str, sources)], check=True)
        return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")])))

    return install
