"""A name -> object registry for one kind of thing plugins contribute (tokenizers, models...)."""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field
from typing import Any


class PluginError(Exception):
    """Base class of the errors plugin loading and look-ups raise."""


class DuplicateNameError(PluginError):
    pass


class UnknownNameError(PluginError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


@dataclass
class Entry:
    name: str
    target: Any  # the object, or an import path "module:attribute" resolved on first use
    plugin: str
    distribution: str
    version: str
    description: str = ""
    _resolved: Any = field(default=None, repr=False)

    @property
    def origin(self) -> str:
        return f"{self.distribution} {self.version}".strip()

    def load(self) -> Any:
        if self._resolved is None:
            self._resolved = resolve(self.target)
        return self._resolved


def resolve(target: Any) -> Any:
    """Import ``"package.module:attr.sub"``; any other object is returned as it is."""
    if not isinstance(target, str):
        return target
    module_name, _, attribute = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in filter(None, attribute.split(".")):
        obj = getattr(obj, part)
    return obj


class Registry:
    """Everything registered of one kind, e.g. ``Registry("tokenizer")``."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        # A name two plugins claim stays unusable (never silently one of them) until one goes.
        self._conflicts: dict[str, str] = {}

    def add(self, entry: Entry) -> None:
        existing = self._entries.get(entry.name)
        if existing is not None:
            message = (
                f"{self.kind} {entry.name!r} is registered twice: by plugin {existing.plugin!r} "
                f"({existing.origin}) and by plugin {entry.plugin!r} ({entry.origin}); "
                f"uninstall one or disable it with MEGA_DISABLE_PLUGINS"
            )
            self._conflicts[entry.name] = message
            raise DuplicateNameError(message)
        self._entries[entry.name] = entry

    def entry(self, name: str) -> Entry:
        if name in self._conflicts:
            raise DuplicateNameError(self._conflicts[name])
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(self._unknown_message(name)) from None

    def get(self, name: str) -> Any:
        """The registered object (imported now if it was registered by import path)."""
        entry = self.entry(name)
        try:
            return entry.load()
        except Exception as error:
            raise PluginError(
                f"{self.kind} {name!r} from {entry.origin} failed to load: "
                f"{type(error).__name__}: {error}"
            ) from error

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[name] for name in self.names()]

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _unknown_message(self, name: str) -> str:
        message = f"no {self.kind} {name!r}"
        close = difflib.get_close_matches(name, self._entries, n=3, cutoff=0.5)
        # A prefix is a strong hint too ("GPT2BPE" -> "GPT2BPETokenizer").
        close += [n for n in self.names() if n.lower().startswith(name.lower()) and n not in close]
        if close:
            message += f"; did you mean {', '.join(close)}?"
        if self._entries:
            installed = ", ".join(f"{e.name} (from {e.origin})" for e in self.entries())
            message += f"; installed: {installed}"
        else:
            message += f"; no {self.kind} is installed (is the package that provides it installed?)"
        return message
