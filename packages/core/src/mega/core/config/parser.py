"""Parse config dataclasses from a TOML file and/or Megatron-style flags.

Precedence: dataclass defaults < TOML file (``--config FILE``, one table per section) < flags.
An unknown flag or TOML key fails with the closest known names; an ``explain`` object (see
mega.core.plugins.failed_options) may add why it is unknown: a plugin that failed to load.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from mega.core.config.options import flag_of, help_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad flag, TOML key or value; the message names it."""


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _argument_kwargs(field: dataclasses.Field, annotation: Any) -> dict[str, Any]:
    annotation = _unwrap_optional(annotation)
    kwargs: dict[str, Any] = {"help": help_of(field)}
    if annotation is bool:
        # A flag that turns something off (--no-load-optim, --disable-bias-linear) sets False.
        negative = flag_of(field).startswith(("--no-", "--disable-"))
        kwargs["action"] = field.metadata.get("action") or ("store_false" if negative else "store_true")
        return kwargs
    origin = typing.get_origin(annotation)
    if origin in (list, tuple):
        item = typing.get_args(annotation)[0] if typing.get_args(annotation) else str
        kwargs.update(nargs="+", type=item)
        if field.metadata.get("action"):  # "extend": repeated flags add up (else the last one wins, as Megatron's)
            kwargs["action"] = field.metadata["action"]
    elif origin is Literal:
        kwargs.update(choices=typing.get_args(annotation))
    else:
        kwargs["type"] = annotation
    if field.metadata.get("choices"):
        kwargs["choices"] = field.metadata["choices"]
    kwargs["metavar"] = field.name.upper() if "choices" not in kwargs else None
    return kwargs


def add_section(parser: argparse.ArgumentParser, section: str, cls: type, title: str | None = None,
                defaults: Any = None) -> None:
    """Add one argument group (headed ``title``) with a flag for every field of the dataclass ``cls``;
    the help shows the class defaults, or the values of ``defaults`` (an instance, or a dict: the
    starting point a preset or a checkpoint gives the section)."""
    group = parser.add_argument_group(title or section)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        kwargs = _argument_kwargs(field, hints[field.name])
        if kwargs.get("metavar") is None:
            kwargs.pop("metavar", None)
        default = field.default if field.default is not dataclasses.MISSING else None
        if defaults is not None:
            default = defaults.get(field.name, default) if isinstance(defaults, dict) else getattr(defaults, field.name)
        if default not in (None, False, True) and kwargs.get("help") is not None:
            kwargs["help"] += f" (default: {default})"
        # SUPPRESS: only flags actually given appear in the namespace, so they can override TOML.
        group.add_argument(flag_of(field), dest=f"{section}.{field.name}", default=argparse.SUPPRESS, **kwargs)


def known_flags(sections: dict[str, type]) -> list[str]:
    return [flag_of(f) for cls in sections.values() for f in dataclasses.fields(cls) if f.init]


def _suggest(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=3, cutoff=0.6)
    return f"; did you mean {', '.join(close)}?" if close else ""


def _unknown(kind: str, word: str, candidates: list[str], explain: Any) -> str:
    """What follows ``unknown flag --x``: why (a plugin that did not load), or the closest names."""
    reason, certain = getattr(explain, kind)(word) if explain is not None else ("", False)
    return reason if certain else _suggest(word, candidates) + reason


def load_toml(path: str | Path, sections: dict[str, type], explain: Any = None) -> dict[str, dict[str, Any]]:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None
    values: dict[str, dict[str, Any]] = {}
    for section, table in data.items():
        if section not in sections:
            raise ConfigError(f"{path}: unknown section [{section}]{_unknown('section', section, list(sections), explain)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{section}] must be a table of settings")
        hints = typing.get_type_hints(sections[section])
        names = [f.name for f in dataclasses.fields(sections[section]) if f.init]
        for key, value in table.items():
            if key not in names:
                raise ConfigError(f"{path}: unknown key {key!r} in [{section}]{_suggest(key, names)}")
            if not _value_fits(value, hints[key]):
                raise ConfigError(
                    f"{path}: [{section}] {key} = {value!r} is not a valid {_type_name(hints[key])}"
                )
        values[section] = dict(table)
    return values


def _value_fits(value: Any, annotation: Any) -> bool:
    if value is None:
        return True
    annotation = _unwrap_optional(annotation)
    origin = typing.get_origin(annotation)
    if origin in (list, tuple):
        return isinstance(value, list)
    if origin is Literal:
        return value in typing.get_args(annotation)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation) if isinstance(annotation, type) else True


def _type_name(annotation: Any) -> str:
    annotation = _unwrap_optional(annotation)
    return getattr(annotation, "__name__", str(annotation))


def parse(argv: list[str], sections: dict[str, type], parser: argparse.ArgumentParser,
          bases: dict[str, Any] | None = None, explain: Any = None) -> dict[str, Any]:
    """Parse ``argv`` (with an optional ``--config FILE``) into one dataclass per section.

    ``bases`` gives a section a starting instance (a model preset) instead of the class defaults;
    what the instance only derived is derived again from the values in force (see chosen_values).
    A base given as a dict (a checkpoint's saved config) is taken whole.
    ``explain.flag(word)`` / ``explain.section(name)`` say why a flag or table is unknown
    (``(text, certain)``; certain: the closest known names are not suggested).
    """
    bases = bases or {}
    namespace, unknown = parser.parse_known_args(argv)
    for word in unknown:
        if word.startswith("-"):
            flag = word.split("=", 1)[0]
            parser.error(f"unknown flag {flag}{_unknown('flag', flag, known_flags(sections), explain)}")
    if unknown:
        parser.error(f"unexpected argument {unknown[0]!r}")

    values = load_toml(namespace.config, sections, explain) if getattr(namespace, "config", None) else {}
    for dest, value in vars(namespace).items():
        if "." in dest:
            section, name = dest.split(".", 1)
            values.setdefault(section, {})[name] = value

    configs = {}
    for section, cls in sections.items():
        try:
            given = values.get(section, {})
            base = bases.get(section, {})
            start = dict(base) if isinstance(base, dict) else chosen_values(base)
            configs[section] = cls(**{**start, **given})
        except (TypeError, ValueError) as error:
            raise ConfigError(f"[{section}]: {error}") from None
    return configs


def chosen_values(config: Any) -> dict[str, Any]:
    """The init fields of a config instance that were chosen rather than derived.

    A field whose class default is None is derived in ``__post_init__`` from others (Megatron's
    kv_channels = hidden / heads, ffn = 4 * hidden, ...). Where the instance holds exactly what
    the class would derive, the field is left out, so that flags changing what it derives from
    change it too: ``--model-preset tiny --hidden-size 4096 --num-attention-heads 32`` gets 128
    channels per head, not the preset's 16.
    """
    fields = [field for field in dataclasses.fields(config) if field.init]
    derivable = {field.name for field in fields if field.default is None}
    try:
        derived = dataclasses.replace(config, **dict.fromkeys(derivable))
    except (TypeError, ValueError):
        # What the class derives from the others is no valid config (gpt-oss: 2880 / 64 heads
        # gives an odd head size): each field is then derived alone, and one that cannot be is chosen.
        return {field.name: getattr(config, field.name) for field in fields
                if field.name not in derivable or not _derives_alone(config, field.name)}
    return {field.name: getattr(config, field.name) for field in fields
            if field.name not in derivable or getattr(config, field.name) != getattr(derived, field.name)}


def _derives_alone(config: Any, name: str) -> bool:
    """Whether the class derives the value ``config`` holds for ``name`` from the other fields."""
    try:
        return getattr(dataclasses.replace(config, **{name: None}), name) == getattr(config, name)
    except (TypeError, ValueError):
        return False


def flag_reference(sections: dict[str, type]) -> str:
    """A Markdown table of every flag, generated from the same declarations as the parser."""
    lines = ["| flag | section | default | meaning |", "|---|---|---|---|"]
    for section, cls in sections.items():
        for field in dataclasses.fields(cls):
            if not field.init:
                continue
            default = field.default if field.default is not dataclasses.MISSING else ""
            lines.append(f"| `{flag_of(field)}` | {section} | {default} | {help_of(field)} |")
    return "\n".join(lines)
