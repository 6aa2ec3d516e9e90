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
import contextlib
import io
import os
import sys

from mega.core.cli.argparser import CommandParser
from mega.core.config import ConfigError, add_section, flag_reference, parse
from mega.core.config.parser import known_flags, tomllib
from mega.core.plugins import PluginError, get_plugins
from mega.core.plugins.install_hint import repository_package
from mega.core.plugins.options import option_sections
from mega.core.plugins.training_check import check_plugins_for_training
from mega.core.training import default_run

DESCRIPTION = "Pretrain a decoder-only language model at any parallel layout (Megatron's flags)."
# The model families (GPT, LLaMA) ship in mega-models, which is installed from the repository.
MODELS_HINT = repository_package("mega-models", "packages/models")


def _launcher_parser() -> argparse.ArgumentParser:
    """Flags that are not config fields: where the config comes from and how many processes."""
    parser = CommandParser(add_help=False)
    parser.add_argument("--config", help="TOML file with [training], [model], [parallel]... tables")
    parser.add_argument("--nproc-per-node", type=int, help="start this many local processes (like torchrun)")
    parser.add_argument("--max-restarts", type=int, help="restart every rank after a failure up to N times, "
                        "resuming from the newest checkpoint in --save (torchrun's elastic agent)")
    return parser


def _early_parser() -> argparse.ArgumentParser:
    """What must be known before the full parser exists: it depends on the model family."""
    parser = _launcher_parser()
    parser.add_argument("--model-family", default=None)
    parser.add_argument("--model-preset", default=None)
    return parser


def build_parser(model_config_class: type | None, family_name: str, plugins=None,
                 options: dict[str, tuple[type, str]] | None = None) -> argparse.ArgumentParser:
    """The full parser; without a model config class (none installed), every other section; then
    each plugin's options under the plugin's name (``options``: from :func:`plugin_sections`)."""
    parser = CommandParser(
        prog="mega train", description=DESCRIPTION, parents=[_launcher_parser()],
        epilog="With no arguments, trains the embedded default: a small GPT on the text of Python's "
               "pydoc topics, on the CPU, in about two minutes.",
    )
    sections = core_sections(model_config_class)
    for name, cls in sections.items():
        add_section(parser, name, cls, title=f"model ({family_name} family)" if name == "model" else None)
    options = plugin_sections(sections, plugins) if options is None else options
    for name, (cls, title) in options.items():
        add_section(parser, name, cls, title=title)
    return parser


def core_sections(model_config_class: type | None) -> dict[str, type]:
    from mega.core.training.run_config import SECTIONS, run_sections  # start-up cost: torch

    return run_sections(model_config_class) if model_config_class is not None else SECTIONS


def plugin_sections(sections: dict[str, type], plugins=None) -> dict[str, tuple[type, str]]:
    taken = {"-h", "--help", "--config", "--nproc-per-node", "--max-restarts", *known_flags(sections)}
    return option_sections(plugins or get_plugins(), taken, set(sections))


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
    plugin_options = plugin_sections(sections, plugins)
    parser = build_parser(family.config_class, family_name, plugins, plugin_options)
    options = {name: cls for name, (cls, _) in plugin_options.items()}
    configs = parse(argv, {**sections, **options}, parser, bases=bases)
    return RunConfig(**{name: configs[name] for name in sections},
                     plugins={name: configs[name] for name in options}), family


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
        "one table per section; flags override it), `--nproc-per-node N` (start N local processes) and\n"
        "`--max-restarts N` (restart every rank after a failure, resuming from `--save`).\n\n"
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
    if early.nproc_per_node or early.max_restarts is not None:
        from mega.core.training.launch_job import launch_job  # start-up cost: torch

        return launch_job(early.nproc_per_node or 1, ["train", *_without_launcher_flags(argv)], early.max_restarts)
    try:
        run, family = parse_run(argv)
    except PluginError as error:
        if {"-h", "--help"} & set(argv):
            # The help still helps (a family not installed, contested or broken); its flags are missing.
            build_parser(None, "").print_help()
            hint = MODELS_HINT if MODELS_HINT in str(error) else str(error)
            print(f"\nmodel flags (--num-layers, --hidden-size, ...) come from a model family: {hint}")
            return 0
        print(f"mega train: error: {error}", file=sys.stderr)
        return 2
    except (ConfigError, KeyError) as error:
        print(f"mega train: error: {error}", file=sys.stderr)
        return 2
    try:
        skipped = check_plugins_for_training(get_plugins(), run.training.skip_failed_plugins)
    except PluginError as error:
        print(f"mega train: error: {error}", file=sys.stderr)
        return 2
    if skipped and os.environ.get("RANK", "0") == "0":  # one warning per job, not per rank
        print("mega train: warning: --skip-failed-plugins: training without " + "; ".join(skipped), file=sys.stderr)
    from mega.core.training.launch_run import train  # start-up cost: torch

    return train(run, family)


def start_ranks(nproc: int, command: list[str], max_restarts: int | None = None,
                program: tuple[str, ...] = (sys.executable, "-m", "mega.core.cli.main")) -> int:
    """Start the local ranks of ``command`` (``["train", ...]``), with what the launcher must know
    of the run read from it as a rank reads it (see mega.core.training.launch_job)."""
    from mega.core.training.launch_job import launch_job  # start-up cost: torch, for launchers only

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the ranks parse it again and say what is wrong
            run = parse_run(command[1:])[0]
    except (Exception, SystemExit):  # noqa: BLE001
        run = None
    return launch_job(nproc, command, run, max_restarts, program=program)


def _without_launcher_flags(argv: list[str]) -> list[str]:
    """``argv`` for the ranks: without --nproc-per-node and --max-restarts (and their values)."""
    flags = ("--nproc-per-node", "--max-restarts")
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
            continue
        if word in flags:
            skip = True
            continue
        if word.startswith(tuple(flag + "=" for flag in flags)):
            continue
        out.append(word)
    return out

