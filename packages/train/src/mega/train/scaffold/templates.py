"""The files ``mega plugins new`` writes, one set per kind (``string.Template``: ``$name`` the
registered name, ``$module`` the Python package and entry-point name, ``$dist`` the distribution)."""

from __future__ import annotations

PYPROJECT = '''[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "$dist"
version = "0.1.0"
description = "$summary"
readme = "README.md"
requires-python = ">=3.10"
dependencies = [$dependencies]

[project.optional-dependencies]
test = ["pytest"]

# The entry point mega discovers: its name is the plugin's (MEGA_DISABLE_PLUGINS=$module, the
# [$module] table of `mega train --config`), its value the module whose hooks register things.
[project.entry-points.mega]
$module = "$module"

[tool.hatch.build.targets.wheel]
packages = ["$module"]
'''

README = '''# $dist

$summary: a plugin for mega, written by `mega plugins new $name --kind $kind`.

Install it beside mega (the way mega's README installs, with its constraints file) and check it:

```console
pip install -c constraints.txt -e "./$dist[test]"
mega plugins                      # lists $module ($dist) and what it registered
pytest $dist/tests                # against the installed mega
```

$usage

docs/plugins.md in the mega repository states the contract of every hook.
'''

KINDS = {}

KINDS["family"] = dict(
    summary="GPT with a ReLU MLP, a model family derived from mega-models' gpt",
    dependencies=["mega-core", "mega-models"],
    usage="`mega train --model-family $name --model-preset tiny --mock-data` trains it; every flag of the "
          "gpt family applies (`--activation gelu` gives gpt back). `family.py` derives it with "
          "`mega.models.variant`; change the defaults there.",
    files={
        "$module/__init__.py": '''"""$name: GPT with a ReLU MLP (registered by import path: `mega --help` imports no torch for it)."""

from mega.core.plugins import hookimpl


@hookimpl
def register_models(register):
    register("$name", "$module.family:FAMILY", "GPT with a ReLU MLP")
''',
        "$module/family.py": '''"""The family: mega-models' gpt with other config defaults (every gpt flag still applies)."""

from mega.models import gpt, variant

FAMILY = variant(gpt.FAMILY, "$name", activation="relu", description="GPT with a ReLU MLP")
''',
        "tests/test_$module.py": '''"""The installed family is gpt with a ReLU MLP: same weights from the same seed, same logits."""

import torch

from mega.core.build import build_stage
from mega.core.plugins import get_plugins
from mega.models import gpt


def test_the_family_computes_what_gpt_with_a_relu_mlp_computes():
    family = get_plugins().models.get("$name")
    config = family.preset("tiny", vocab_size=512)
    assert config.mlp_activation == "relu"
    ours = build_stage(family, config, seed=3).eval()  # eval: no dropout
    reference = build_stage(gpt.FAMILY, gpt.FAMILY.preset("tiny", vocab_size=512, activation="relu"), seed=3).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    torch.testing.assert_close(ours({"tokens": tokens})["logits"], reference({"tokens": tokens})["logits"])
''',
    },
)

KINDS["callback"] = dict(
    summary="A training callback that writes each step's loss to a CSV file",
    dependencies=["mega-core"],
    usage="`mega train --$flag loss.csv ...` (listed under `plugin $module` in `mega train --help`), or "
          "in the TOML of `mega train --config`:\n\n```toml\n[$module]\n$field = \"loss.csv\"\n```",
    files={
        "$module/__init__.py": '''"""$name: writes each step's loss to a CSV file (`mega train --$flag FILE`)."""

from __future__ import annotations

from dataclasses import dataclass

from mega.core.config import option
from mega.core.plugins import hookimpl

PLUGIN = "$module"  # the entry-point name: run_config.plugins[PLUGIN], the [$module] TOML table


@dataclass
class Options:
    """The flags this plugin adds to `mega train`, declared as the core declares its own."""

    $field: str | None = option(None, "write each step's loss to this CSV file")


class LossCsv:
    """One run's listener: implements the event hooks it needs (docs/plugins.md lists them all)."""

    def __init__(self, path: str):
        self.path = path

    @hookimpl
    def on_train_start(self, run):
        if run.is_logging_rank:  # every rank gets the events; one writes
            with open(self.path, "w", encoding="utf-8") as handle:
                handle.write("iteration,loss\\n")

    @hookimpl
    def on_step_end(self, run, iteration, metrics):
        if run.is_logging_rank:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(f"{iteration},{metrics['loss']}\\n")


def make_listener(run_config):
    """Called once per run; None keeps the callback out of runs that did not ask for it."""
    options = run_config.plugins.get(PLUGIN, Options())
    return LossCsv(options.$field) if options.$field else None


@hookimpl
def register_callbacks(register):
    register("$name", make_listener, "write each step's loss to a CSV file", options=Options)
''',
        "tests/test_$module.py": '''"""The installed callback: its flag is in `mega train --help`, and its listener writes the CSV."""

import subprocess
import sys
from types import SimpleNamespace

from mega.core.plugins import Events, get_plugins
from mega.train.run_config import RunConfig
from $module import Options


def test_mega_train_lists_the_flag_under_the_plugin():
    done = subprocess.run([sys.executable, "-m", "mega.core.cli.main", "train", "--help"],
                          capture_output=True, text=True, check=True)
    assert "plugin $module ($dist)" in done.stdout and "--$flag" in done.stdout


def test_the_listener_writes_each_steps_loss(tmp_path):
    path = tmp_path / "loss.csv"
    factory = get_plugins().callbacks.get("$name")
    assert factory(RunConfig(model=None)) is None  # not asked for: takes no part
    events = Events([factory(RunConfig(model=None, plugins={"$module": Options(str(path))}))])
    run = SimpleNamespace(is_logging_rank=True)
    events.hook.on_train_start(run=run)
    for iteration, loss in ((1, 2.5), (2, 2.25)):
        events.hook.on_step_end(run=run, iteration=iteration, metrics={"loss": loss})
    assert path.read_text() == "iteration,loss\\n1,2.5\\n2,2.25\\n"
''',
    },
)

KINDS["command"] = dict(
    summary="A `mega $name` command",
    dependencies=["mega-core"],
    usage="`mega $name [WHO]` prints a greeting; `mega --help` lists it. The command parses its own "
          "arguments (`main(argv) -> exit code`).",
    files={
        "$module/__init__.py": '''"""$name: the `mega $name` command (its module is imported only when it runs)."""

from mega.core.plugins import Command, hookimpl


@hookimpl
def register_commands(register):
    register("$name", Command(help="say hello", main="$module.command:main"))
''',
        "$module/command.py": '''"""`mega $name [WHO]`."""

import argparse


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mega $name", description="Say hello.")
    parser.add_argument("who", nargs="?", default="world")
    args = parser.parse_args(argv)
    print(f"hello, {args.who}")
    return 0
''',
        "tests/test_$module.py": '''"""The installed command runs through `mega` and is listed by `mega --help`."""

import subprocess
import sys


def mega(*args):
    return subprocess.run([sys.executable, "-m", "mega.core.cli.main", *args], capture_output=True, text=True,
                          check=True).stdout


def test_the_command_runs():
    assert mega("$name", "plugin author") == "hello, plugin author\\n"
    assert "$name" in mega("--help")
''',
    },
)

KINDS["kernel"] = dict(
    summary="A kernel backend whose activation is a hand-written tanh-approximated GELU",
    dependencies=["mega-core"],
    usage="`mega train --activation gelu_tanh --activation-backend $name ...` uses it; `mega plugins` lists "
          "it as usable. A backend fills some component kinds (docs/plugins.md: the kinds and their "
          "signatures); the torch backend fills the others.",
    files={
        "$module/__init__.py": '''"""$name: a kernel backend filling the `activation` kind (imported when selected)."""

from mega.core.plugins import hookimpl


@hookimpl
def register_kernel_backends(register):
    register("$name", "$module.backend:BACKEND", "hand-written tanh-approximated GELU")
''',
        "$module/backend.py": '''"""The backend: ``kinds``, ``component(kind)`` and ``is_available()``."""

import math

import torch


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def activation(name: str):
    """The ``activation`` component: ``factory(name) -> fn``."""
    if name != "gelu_tanh":
        raise ValueError(f"the $name kernel backend computes gelu_tanh only, not {name!r}")
    return gelu_tanh


class Backend:
    name, kinds = "$name", frozenset({"activation"})

    def is_available(self) -> tuple[bool, str]:
        return True, ""  # or (False, "what is missing, and how to install it")

    def component(self, kind: str):
        return {"activation": activation}[kind]


BACKEND = Backend()
''',
        "tests/test_$module.py": '''"""The installed backend is selected by name and computes torch's tanh-approximated GELU."""

import pytest
import torch
import torch.nn.functional as F

from mega.core.kernels import Kernels
from mega.core.plugins import get_plugins


def test_the_backend_computes_torchs_gelu_tanh():
    kernels = Kernels({"activation": "$name"}, get_plugins())
    x = torch.randn(4, 64, dtype=torch.float64)
    torch.testing.assert_close(kernels.activation("gelu_tanh")(x), F.gelu(x, approximate="tanh"))
    with pytest.raises(ValueError, match="gelu_tanh only"):
        kernels.activation("relu")
''',
    },
)

KINDS["tokenizer"] = dict(
    summary="A tokenizer with one token per UTF-8 byte",
    dependencies=["mega-core"],
    usage="`--tokenizer-type $name` works wherever mega takes a tokenizer (`mega preprocess`, `mega train`).",
    files={
        "$module/__init__.py": '''"""$name: one token per UTF-8 byte; 256 ends a document."""

from mega.core.plugins import hookimpl
from mega.core.tokenizer import TokenizerOptions


class ByteTokenizer:
    vocab_size, eod, pad, bos = 257, 256, None, None

    def __init__(self, options: TokenizerOptions):
        pass  # nothing to load: the vocabulary is the 256 byte values

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@hookimpl
def register_tokenizers(register):
    register("$name", ByteTokenizer, "one token per UTF-8 byte")
''',
        "tests/test_$module.py": '''"""The installed tokenizer is found by its --tokenizer-type name and round-trips text."""

from mega.core.plugins import get_plugins
from mega.core.tokenizer import Tokenizer, TokenizerOptions


def test_the_tokenizer_round_trips():
    tokenizer = get_plugins().tokenizers.get("$name")(TokenizerOptions())
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.tokenize("hé") == [104, 195, 169]
    assert tokenizer.detokenize(tokenizer.tokenize("héllo") + [tokenizer.eod]) == "héllo"
''',
    },
)

KINDS["checkpoint-format"] = dict(
    summary="A checkpoint format: every tensor in one torch.save file, the model config in JSON",
    dependencies=["mega-core", "mega-ckpt-convert", "mega-models"],
    usage="`mega convert --input DIR --to hf --output OUT` reads a checkpoint in it (the format is detected; "
          "`--from` and `--to` name mega-ckpt-convert's own formats), and `mega.ckpt_convert.open_checkpoint(DIR)` "
          "opens one. The contract is mega-ckpt-convert's `CheckpointFormat`: `detect`, `open` -> a source of "
          "global tensors by Megatron-Core name, `write`.",
    files={
        "$module/__init__.py": '''"""$name: a checkpoint format (imported when used)."""

from mega.core.plugins import hookimpl


@hookimpl
def register_checkpoint_formats(register):
    register("$name", "$module.format:FORMAT", "every tensor in one torch.save file, the config in JSON")
''',
        "$module/format.py": '''"""The format: ``detect(path)``, ``open(path) -> source``, ``write(source, directory, options)``."""

import dataclasses
import json
from pathlib import Path

import torch

from mega.core.plugins import get_plugins

TENSORS, CONFIG = "tensors.pt", "model.json"


class Source:
    """A model's tensors by global (Megatron-Core) name, and its family and config."""

    def __init__(self, path: Path):
        saved = json.loads((path / CONFIG).read_text(encoding="utf-8"))
        family = get_plugins().models.get(saved["family"])
        self.family, self.config = saved["family"], family.config_class(**saved["config"])
        self.tokenizer, self.tokenizer_extras = None, {}
        self._tensors = torch.load(path / TENSORS, map_location="cpu", weights_only=True)

    def names(self):
        return sorted(self._tensors)

    def shape(self, name):
        return tuple(self._tensors[name].shape)

    def dtype(self, name):
        return self._tensors[name].dtype

    def get(self, name):
        return self._tensors[name]

    def close(self):
        self._tensors = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Format:
    name = "$name"

    def detect(self, path) -> bool:
        return (Path(path) / TENSORS).is_file() and (Path(path) / CONFIG).is_file()

    def open(self, path, model_family=None) -> Source:
        return Source(Path(path))

    def write(self, source, directory, options) -> list[str]:
        directory = Path(directory)
        torch.save({name: source.get(name).contiguous() for name in source.names()}, directory / TENSORS)
        config = {f.name: getattr(source.config, f.name) for f in dataclasses.fields(source.config) if f.init}
        (directory / CONFIG).write_text(json.dumps({"family": source.family, "config": config}), encoding="utf-8")
        # Nothing dropped silently: what this format does not keep is said.
        return [] if source.tokenizer is None else [f"$name keeps no tokenizer ({source.tokenizer.type} dropped)"]


FORMAT = Format()
''',
        "tests/test_$module.py": '''"""A model written in the installed format and opened again holds the same tensors and config,
and the model rebuilt from them computes the same logits."""

import torch

from mega.core.build import build_stage
from mega.core.plugins import get_plugins


class StateDictSource:
    def __init__(self, family, config, state):
        self.family, self.config, self.tokenizer, self.tokenizer_extras = family, config, None, {}
        self.state = state

    def names(self):
        return sorted(self.state)

    def get(self, name):
        return self.state[name]


def test_a_written_model_opens_as_the_same_model(tmp_path):
    plugins = get_plugins()
    checkpoint_format = plugins.checkpoint_formats.get("$name")
    family = plugins.models.get("gpt")
    config = family.preset("tiny", vocab_size=512)
    model = build_stage(family, config, seed=5).eval()  # eval: no dropout
    state = {name: tensor for name, tensor in model.state_dict().items() if isinstance(tensor, torch.Tensor)}
    assert checkpoint_format.write(StateDictSource("gpt", config, state), tmp_path, None) == []
    assert checkpoint_format.detect(tmp_path)
    with checkpoint_format.open(tmp_path) as source:
        assert source.config == config and source.names() == sorted(state)
        loaded = {name: source.get(name) for name in source.names()}
    rebuilt = build_stage(family, config, init=False).eval()
    rebuilt.load_state_dict(loaded)
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    torch.testing.assert_close(rebuilt({"tokens": tokens})["logits"], model({"tokens": tokens})["logits"])
''',
    },
)
