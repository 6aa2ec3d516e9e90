"""`mega plugins list` is `mega plugins` (issue 53, item 8). CPU only, no model."""

from __future__ import annotations

import json

from mega.core.cli.main import main as mega


def test_plugins_list_is_an_alias(capsys):
    assert mega(["plugins", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert mega(["plugins", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == listed
    assert mega(["plugins", "list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plugin ") and "mega-core" in out
