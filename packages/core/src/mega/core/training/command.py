"""``mega train``: Megatron's flags and/or a TOML file in, a trained model out.

    mega train                                   the embedded default (a small GPT on CPU)
    mega train --config run.toml --lr 1e-4       TOML, with flags overriding it
    torchrun --nproc-per-node 8 -m mega.core.cli.main train --tensor-model-parallel-size 2 ...
    mega train --nproc-per-node 4 ...            starts the 4 local processes itself

The flags are generated from the config dataclasses (the model family's config and the sections
in mega.core.training.run_config), so `mega train --help` always lists exactly what is accepted.

The run's modules (run_config, launch_run) are imported where they are used, a start-up cost:
they import torch (1.5 s), which the launcher process of `--nproc-per-node` never needs.
"""

from __future__ import annotations

import argparse
import sys

from mega.core.cli.argparser import CommandParser
from mega.core.config import ConfigError, add_section, flag_reference, parse
from mega.core.config.parser import tomllib
from mega.core.launch import launch_local
from mega.core.plugins import PluginError, get_plugins
from mega.core.training import default_run

DESCRIPTION = "Pretrain a decoder-only language model at any parallel layout (Megatron's flags)."
# The model families (GPT, LLaMA) ship in mega-models, which is installed from the repository.
MODELS_HINT = "install mega-models (pip install -e packages/models, from the mega repository)"


def _launcher_parser() -> argparse.ArgumentParser:
    """Flags that are not config fields: where the config comes from and how many processes."""
    parser = CommandParser(add_help=False)
    parser.add_argument("--config", help="TOML file with [training], [model], [parallel]... tables")
    parser.add_argument("--nproc-per-node", type=int, help="start this many local processes (like torchrun)")
    return parser


def _early_parser() -> argparse.ArgumentParser:
    """What must be known before the full parser exists: it depends on the model family."""
    parser = _launcher_parser()
    parser.add_argument("--model-family", default=None)
    parser.add_argument("--model-preset", default=None)
    return parser


def build_parser(model_config_class: type | None, family_name: str) -> argparse.ArgumentParser:
    """The full parser; without a model config class (none installed), every other section."""
    from mega.core.training.run_config import SECTIONS, run_sections  # start-up cost: torch

    parser = CommandParser(
        prog="mega train", description=DESCRIPTION, parents=[_launcher_parser()],
        epilog="With no arguments, trains the embedded default: a small GPT on the text of Python's "
               "pydoc topics, on the CPU, in about two minutes.",
    )
    sections = run_sections(model_config_class) if model_config_class is not None else SECTIONS
    for name, cls in sections.items():
        add_section(parser, name, cls, title=f"model ({family_name} family)" if name == "model" else None)
    return parser


def parse_run(argv: list[str], plugins=None):
    """Parse ``argv`` into a RunConfig (the family and preset chosen first)."""
    from mega.core.training.run_config import RunConfig, run_sections  # start-up cost: torch

    plugins = plugins or get_plugins()
    early, _ = _early_parser().parse_known_args(argv)
    toml_training = _toml_training_table(early.config) if early.config else {}
    family_name = early.model_family or toml_training.get("model_family") or "gpt"
    if family_name not in plugins.models and not plugins.models.names():
        raise PluginError(f"no model family is installed ({family_name!r} was asked for): {MODELS_HINT}")
    family = plugins.models.get(family_name)
    preset = early.model_preset or toml_training.get("model_preset")
    # A preset is the starting point its flags override; without one the config class derives
    # its dependent sizes (ffn, query groups...) from the flags given.
    bases = {"model": family.preset(preset)} if preset else {}

    sections = run_sections(family.config_class)
    parser = build_parser(family.config_class, family_name)
    configs = parse(argv, sections, parser, bases=bases)
    return RunConfig(**configs), family


def _toml_training_table(path: str) -> dict:
    """The [training] table, read early for the model family and preset (errors come later)."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle).get("training", {})
    except (OSError, tomllib.TOMLDecodeError):
        return {}  # the full parse reports the problem with the file's name


def flag_reference_markdown(family_name: str = "gpt", plugins=None) -> str:
    """docs/training-flags.md: every flag of `mega train`, generated from the config dataclasses."""
    from mega.core.training.run_config import run_sections  # start-up cost: torch

    family = (plugins or get_plugins()).models.get(family_name)
    return (
        "# `mega train` flags\n\n"
        "Generated by `mega train --flag-reference` from the config dataclasses (each field declares its\n"
        "flag once); a test keeps this page in step with the code. Besides these: `--config FILE` (TOML,\n"
        "one table per section; flags override it) and `--nproc-per-node N` (start N local processes).\n\n"
        + flag_reference(run_sections(family.config_class)) + "\n"
    )


def main(argv: list[str]) -> int:
    if argv == ["--flag-reference"]:
        print(flag_reference_markdown(), end="")
        return 0
    if not argv:
        problem = default_run.missing_requirement(get_plugins())
        if problem is not None:
            print(f"mega train: {problem}", file=sys.stderr)
            return 2
        print(default_run.ANNOUNCEMENT, flush=True)
        argv = default_run.DEFAULT_ARGV
    early, _ = _launcher_parser().parse_known_args(argv)
    if early.nproc_per_node:
        return launch_local(early.nproc_per_node, ["train", *_without_nproc(argv)])
    try:
        run, family = parse_run(argv)
    except PluginError as error:
        if {"-h", "--help"} & set(argv) and MODELS_HINT in str(error):
            build_parser(None, "").print_help()  # the help still helps; the model's flags are missing
            print(f"\nmodel flags (--num-layers, --hidden-size, ...) come from a model family: {MODELS_HINT}")
            return 0
        print(f"mega train: error: {error}", file=sys.stderr)
        return 2
    except (ConfigError, KeyError) as error:
        print(f"mega train: error: {error}", file=sys.stderr)
        return 2
    from mega.core.training.launch_run import train  # start-up cost: torch

    return train(run, family)


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
            continue
        if word == "--nproc-per-node":
            skip = True
            continue
        if word.startswith("--nproc-per-node="):
            continue
        out.append(word)
    return out

