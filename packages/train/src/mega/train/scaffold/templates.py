"""The plugin kinds ``mega plugins new`` writes, and the template files it fills for each.

The files are real files shipped with mega-train under ``plugin_templates/`` (so ruff lints them as it
lints any module): ``pyproject.toml.in`` and ``README.md`` for every kind, ``plugin_templates/KIND/``
for the kind's package and its test. A placeholder is a word a Python file may hold anywhere, code
included: ``plugin_name`` the registered name, ``plugin_module`` the Python package and entry-point
name, ``plugin_dist`` the distribution, ``plugin_kind``, ``plugin_summary``, ``plugin_usage``,
``plugin_dependencies``, and a callback option's ``plugin_field`` and ``plugin_flag``.
"""

from __future__ import annotations

import re
from importlib import resources

PLACEHOLDER = re.compile(r"(?<![A-Za-z0-9])plugin_(name|module|dist|kind|summary|usage|dependencies|field|flag)"
                         r"(?![A-Za-z0-9_])")
COMMON = {"pyproject.toml.in": "pyproject.toml", "README.md": "README.md"}

# kind -> its one-line summary, the distributions it depends on, and how a user runs it (README).
KINDS = {
    'family': dict(
        summary="GPT with a ReLU MLP, a model family derived from mega-models' gpt",
        dependencies=['mega-core', 'mega-models'],
        usage='`mega train --model-family plugin_name --model-preset tiny --mock-data` trains it; every '
              'flag of the gpt family applies (`--activation gelu` gives gpt back). `family.py` derives '
              'it with `mega.models.variant`; change the defaults there.',
    ),
    'callback': dict(
        summary="A training callback that writes each step's loss to a CSV file",
        dependencies=['mega-core', 'mega-train'],
        usage='`mega train --plugin_flag loss.csv ...` (listed under `plugin plugin_module` in `mega '
              'train --help`), or in the TOML of `mega train '
              '--config`:\n\n```toml\n[plugin_module]\nplugin_field = "loss.csv"\n```',
    ),
    'command': dict(
        summary='A `mega plugin_name` command',
        dependencies=['mega-core'],
        usage='`mega plugin_name [WHO]` prints a greeting; `mega --help` lists it. The command parses '
              'its own arguments (`main(argv) -> exit code`).',
    ),
    'kernel': dict(
        summary='A kernel backend whose activation is a hand-written tanh-approximated GELU',
        dependencies=['mega-core'],
        usage='`mega train --activation gelu_tanh --activation-backend plugin_name ...` uses it; `mega '
              'plugins` lists it as usable. A backend fills some component kinds (docs/plugins.md: the '
              'kinds and their signatures); the torch backend fills the others.',
    ),
    'tokenizer': dict(
        summary='A tokenizer with one token per UTF-8 byte',
        dependencies=['mega-core'],
        usage='`--tokenizer-type plugin_name` works wherever mega takes a tokenizer (`mega preprocess`, '
              '`mega train`).',
    ),
    'checkpoint-format': dict(
        summary='A checkpoint format: every tensor in one torch.save file, the model config in JSON',
        dependencies=['mega-core', 'mega-ckpt-convert', 'mega-models'],
        usage='`mega convert --input DIR --to hf --output OUT` reads a checkpoint in it (the format is '
              "detected; `--from` and `--to` name mega-ckpt-convert's own formats), and "
              "`mega.ckpt_convert.open_checkpoint(DIR)` opens one. The contract is mega-ckpt-convert's "
              '`CheckpointFormat`: `detect`, `open` -> a source of global tensors by Megatron-Core '
              'name, `write`.',
    ),
}


def fill(text: str, values: dict[str, str]) -> str:
    """``text`` with each placeholder replaced by its value."""
    return PLACEHOLDER.sub(lambda match: values[match.group(1)], text)


def template_files(kind: str) -> dict[str, str]:
    """``{relative path: text}`` of ``kind``'s files, placeholders unfilled."""
    root = resources.files(__package__) / "plugin_templates"
    files = {target: (root / source).read_text(encoding="utf-8") for source, target in COMMON.items()}
    files.update(_tree(root / kind, ""))
    return files


def _tree(directory, prefix: str) -> dict[str, str]:
    files = {}
    for entry in sorted(directory.iterdir(), key=lambda entry: entry.name):
        if entry.is_dir() and entry.name != "__pycache__":
            files.update(_tree(entry, f"{prefix}{entry.name}/"))
        elif entry.is_file() and not entry.name.endswith(".pyc"):
            files[prefix + entry.name] = entry.read_text(encoding="utf-8")
    return files
