"""The plugin of docs/plugins.md, built and installed outside the tree, is discovered and used."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def files_in_doc() -> dict[str, str]:
    """Fenced blocks whose info string names a file: ```python mega_bytes/__init__.py"""
    blocks = re.findall(r"```\w+ (\S+)\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    return dict(blocks)


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory, install_plugins):
    source = tmp_path_factory.mktemp("mega-bytes")
    for name, text in files_in_doc().items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text(text, encoding="utf-8")
    return install_plugins(source)


def mega(env, *args):
    result = subprocess.run(
        [sys.executable, "-m", "mega.core.cli.main", *args], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_doc_has_both_files():
    assert set(files_in_doc()) == {"pyproject.toml", "mega_bytes/__init__.py"}


def test_plugin_is_listed_with_what_it_registered(installed_plugin):
    listing = json.loads(mega(installed_plugin, "plugins", "--json"))
    entry = next(item for item in listing if item["name"] == "bytes")
    assert entry["distribution"] == "mega-bytes" and entry["version"] == "0.1.0"
    assert entry["registered"] == {"tokenizer": ["ByteTokenizer"], "command": ["count-bytes"]}
    assert entry["error"] is None


def test_plugin_is_used(installed_plugin):
    assert mega(installed_plugin, "count-bytes", "héllo").strip() == "6"
    assert "count-bytes" in mega(installed_plugin, "--help")
    code = (
        "from mega.core.plugins import get_plugins\n"
        "from mega.core.tokenizer import TokenizerOptions, Tokenizer\n"
        "tok = get_plugins().tokenizers.get('ByteTokenizer')(TokenizerOptions())\n"
        "assert isinstance(tok, Tokenizer)\n"
        "print(tok.tokenize('hé'), tok.detokenize(tok.tokenize('hé')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=installed_plugin)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[104, 195, 169] hé"


def test_disabling_the_plugin_hides_it(installed_plugin):
    env = dict(installed_plugin, MEGA_DISABLE_PLUGINS="bytes")
    listing = json.loads(mega(env, "plugins", "--json"))
    assert "bytes" not in {item["name"] for item in listing}
