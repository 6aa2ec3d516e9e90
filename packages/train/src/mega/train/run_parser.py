"""``mega train``'s flags: the parser generated from the run's config sections and the plugins'
options, and ``parse_run``, which turns flags and a TOML file into a ``RunConfig``.

The model family is chosen first (``--model-family``, or ``model_family`` in the TOML's
``[training]`` table, with ``--model-preset``), because its config class declares the model's
flags. The launcher of ``--nproc-per-node`` parses the run too (the signal its ranks act on, the
directory a restart resumes from).
"""

from __future__ import annotations

import argparse
import dataclasses

from mega.core.checkpoint.metadata import CheckpointError
from mega.core.checkpoint.saved_model import SavedModel, check_family, check_run_model, saved_model
from mega.core.cli.argparser import CommandParser
from mega.core.config import ConfigError, add_section, parse
from mega.core.config.parser import known_flags, tomllib
from mega.core.model_family import check_flag_of_other_families
from mega.core.plugins import PluginError, get_plugins
from mega.core.plugins.failed_options import FailedPluginOptions, add_failed_plugins_help
from mega.core.plugins.install_hint import repository_package
from mega.core.plugins.options import option_sections
from mega.train.run_config import SECTIONS, RunConfig, run_sections

DESCRIPTION = "Pretrain a decoder-only language model at any parallel layout (Megatron's flags)."
# The model families (GPT, LLaMA) ship in mega-models, which is installed from the repository.
MODELS_HINT = repository_package("mega-models", "packages/models")


# The flags of the launcher (which starts the ranks), not passed on to the ranks.
LAUNCHER_FLAGS = ("--nproc-per-node", "--max-restarts", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                  "--rdzv-conf")


def launcher_parser() -> argparse.ArgumentParser:
    """Flags that are not config fields: where the config comes from and how many processes."""
    parser = CommandParser(add_help=False)
    parser.add_argument("--config", help="TOML file with [training], [model], [parallel]... tables")
    parser.add_argument("--nproc-per-node", type=int, help="start this many local processes (like torchrun)")
    parser.add_argument("--max-restarts", type=int, help="restart every rank after a failure up to N times, "
                        "resuming from the newest checkpoint in --save (torchrun's elastic agent)")
    nodes = parser.add_argument_group("multi-node (torchrun's flags; see docs/multinode.md)")
    nodes.add_argument("--nnodes", help="the job's number of nodes, N or MIN:MAX (elastic); one `mega train` per node")
    nodes.add_argument("--node-rank", type=int, help="this node's number, 0..N-1; node 0 hosts the rendezvous")
    nodes.add_argument("--master-addr", help="node 0's address, the same on every node")
    nodes.add_argument("--master-port", type=int, help="a free port on node 0 for the rendezvous")
    nodes.add_argument("--rdzv-conf", help="the rendezvous's settings, KEY=VALUE,... (torchrun's: last_call_timeout, "
                       "keep_alive_interval, keep_alive_max_attempt, join_timeout)")
    return parser


def _early_parser() -> argparse.ArgumentParser:
    """What must be known before the full parser exists: it depends on the model family."""
    parser = launcher_parser()
    parser.add_argument("--model-family", default=None)
    parser.add_argument("--model-preset", default=None)
    parser.add_argument("--load", default=None)  # a checkpoint gives the model (saved_model)
    return parser


def build_parser(model_config_class: type | None, family_name: str, plugins=None,
                 options: dict[str, tuple[type, str]] | None = None, model_defaults=None) -> argparse.ArgumentParser:
    """The full parser; without a model config class (none installed), every other section; then
    each plugin's options under the plugin's name (``options``: from :func:`plugin_sections`).
    ``model_defaults``: the model's starting point (a preset, a checkpoint's config), whose values
    the help shows as the defaults."""
    parser = CommandParser(
        prog="mega train", description=DESCRIPTION, parents=[launcher_parser()],
        epilog="With no arguments, trains the embedded default: a small GPT on the text of Python's "
               "pydoc topics, on the CPU, in about two minutes.",
    )
    sections = core_sections(model_config_class)
    for name, cls in sections.items():
        add_section(parser, name, cls, title=f"model ({family_name} family)" if name == "model" else None,
                    defaults=model_defaults if name == "model" else None)
    options = plugin_sections(sections, plugins) if options is None else options
    for name, (cls, title) in options.items():
        add_section(parser, name, cls, title=title)
    add_failed_plugins_help(parser, plugins or get_plugins())
    return parser


def core_sections(model_config_class: type | None) -> dict[str, type]:
    return run_sections(model_config_class) if model_config_class is not None else SECTIONS


def plugin_sections(sections: dict[str, type], plugins=None) -> dict[str, tuple[type, str]]:
    taken = {"-h", "--help", "--config", *LAUNCHER_FLAGS, *known_flags(sections)}
    return option_sections(plugins or get_plugins(), taken, set(sections))


def parse_run(argv: list[str], plugins=None):
    """Parse ``argv`` into a RunConfig (the family and preset chosen first)."""
    plugins = plugins or get_plugins()
    early, _ = _early_parser().parse_known_args(argv)
    toml = _toml_tables(early.config) if early.config else {}
    toml_training = toml.get("training", {})
    saved = _saved_model(early.load or toml.get("checkpoint", {}).get("load"), plugins)
    asked_family = early.model_family or toml_training.get("model_family")
    if saved is not None and asked_family is not None:
        check_family(saved, asked_family)
    family_name = asked_family or (saved.family if saved else "gpt")
    if family_name not in plugins.models and not plugins.models.names():
        raise PluginError(f"no model family is installed ({family_name!r} was asked for): {MODELS_HINT}")
    family = plugins.models.get(family_name)
    preset = early.model_preset or toml_training.get("model_preset")
    # A checkpoint to load, else a preset, is the starting point flags override; without either
    # the config class derives its dependent sizes (ffn, query groups...) from the flags given.
    # The checkpoint's config is taken whole (nothing derived again: --seq-length keeps its table).
    bases = {"model": dict(saved.config)} if saved else {"model": family.preset(preset)} if preset else {}

    sections = run_sections(family.config_class)
    plugin_options = plugin_sections(sections, plugins)
    parser = build_parser(family.config_class, family_name, plugins, plugin_options, model_defaults=bases.get("model"))
    options = {name: cls for name, (cls, _) in plugin_options.items()}
    known = {option for action in parser._actions for option in action.option_strings}
    for flag in dict.fromkeys(word.split("=", 1)[0] for word in argv if word.startswith("--")):
        if flag not in known:
            check_flag_of_other_families(flag, family, plugins.models)
    configs = parse(argv, {**sections, **options}, parser, bases=bases, explain=FailedPluginOptions(plugins))
    run = RunConfig(**{name: configs[name] for name in sections}, plugins={name: configs[name] for name in options})
    if saved is not None:
        run = _with_saved_model(run, saved)
        run = dataclasses.replace(run, training=dataclasses.replace(run.training, model_family=family_name))
    return run, family


def _saved_model(load: str | None, plugins) -> SavedModel | None:
    try:
        return saved_model(load, plugins)
    except CheckpointError as error:
        raise ConfigError(str(error)) from None


def _with_saved_model(run: RunConfig, saved: SavedModel) -> RunConfig:
    """The run checked against the checkpoint it loads, with the checkpoint's tokenizer (the
    vocabulary the weights were trained with) where it reads data and names no tokenizer (mock
    data tokenizes nothing)."""
    check_run_model(saved, run.model)
    if run.data.tokenizer_type is not None or saved.tokenizer is None or run.data.mock_data:
        return run
    options = saved.tokenizer.options
    run = dataclasses.replace(run, data=dataclasses.replace(
        run.data, tokenizer_type=saved.tokenizer.type, tokenizer_model=options.tokenizer_model,
        vocab_file=options.vocab_file, merge_file=options.merge_file, vocab_extra_ids=options.vocab_extra_ids))
    if options.vocab_size is not None:
        # A tokenizer sized by --vocab-size (NullTokenizer) is rebuilt from the size it was given,
        # not from the model's, which it had grown (by its end-of-document id).
        run = dataclasses.replace(run, model=dataclasses.replace(run.model, vocab_size=options.vocab_size))
    return run


def _toml_tables(path: str) -> dict:
    """The file's tables, read early for the model family, preset and checkpoint (errors come later)."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError):
        return {}  # the full parse reports the problem with the file's name
