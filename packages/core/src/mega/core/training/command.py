"""``mega train``: Megatron's flags and/or a TOML file in, a trained model out.

    mega train                                   the embedded default (a small GPT on CPU)
    mega train --config run.toml --lr 1e-4       TOML, with flags overriding it
    torchrun --nproc-per-node 8 -m mega.core.cli.main train --tensor-model-parallel-size 2 ...
    mega train --nproc-per-node 4 ...            starts the 4 local processes itself

The flags are generated from the config dataclasses (the model family's config and the sections
in mega.core.training.run_config), so `mega train --help` always lists exactly what is accepted.
"""

from __future__ import annotations

import argparse
import sys

from mega.core.config import ConfigError, add_section, parse
from mega.core.config.parser import tomllib
from mega.core.plugins import PluginError, get_plugins

DESCRIPTION = "Pretrain a decoder-only language model at any parallel layout (Megatron's flags)."


def _launcher_parser() -> argparse.ArgumentParser:
    """Flags that are not config fields: where the config comes from and how many processes."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", help="TOML file with [training], [model], [parallel]... tables")
    parser.add_argument("--nproc-per-node", type=int, help="start this many local processes (like torchrun)")
    return parser


def _early_parser() -> argparse.ArgumentParser:
    """What must be known before the full parser exists: it depends on the model family."""
    parser = _launcher_parser()
    parser.add_argument("--model-family", default=None)
    parser.add_argument("--model-preset", default=None)
    return parser


def build_parser(model_config_class: type, family_name: str) -> argparse.ArgumentParser:
    from mega.core.training.run_config import SECTIONS

    parser = argparse.ArgumentParser(
        prog="mega train", description=DESCRIPTION, parents=[_launcher_parser()],
        epilog="With no arguments, trains the embedded default: a small GPT on the text of Python's "
               "pydoc topics, on the CPU, in about two minutes.",
    )
    add_section(parser, "model", model_config_class, title=f"model ({family_name} family)")
    for name, cls in SECTIONS.items():
        add_section(parser, name, cls)
    return parser


def parse_run(argv: list[str], plugins=None):
    """Parse ``argv`` into a RunConfig (the family and preset chosen first)."""
    from mega.core.training.run_config import SECTIONS, RunConfig

    plugins = plugins or get_plugins()
    early, _ = _early_parser().parse_known_args(argv)
    toml_training = _toml_training_table(early.config) if early.config else {}
    family_name = early.model_family or toml_training.get("model_family") or "gpt"
    family = plugins.models.get(family_name)
    preset = early.model_preset or toml_training.get("model_preset")
    # A preset is the starting point its flags override; without one the config class derives
    # its dependent sizes (ffn, query groups...) from the flags given.
    bases = {"model": family.preset(preset)} if preset else {}

    sections = {"model": family.config_class, **SECTIONS}
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


def main(argv: list[str]) -> int:
    if not argv:
        from mega.core.training.default_run import main as default_main

        return default_main()
    early, _ = _launcher_parser().parse_known_args(argv)
    if early.nproc_per_node:
        from mega.core.launch import launch_local

        return launch_local(early.nproc_per_node, ["train", *_without_nproc(argv)])
    try:
        run, family = parse_run(argv)
    except (ConfigError, PluginError, KeyError) as error:
        print(f"mega train: error: {error}", file=sys.stderr)
        return 2
    from mega.core.training.launch_run import train

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

