"""A name -> object registry for one kind of thing plugins contribute (tokenizers, models...)."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mega.core.plugins.failures import FailedPlugin, failure_line


class PluginError(Exception):
    """Base class of the errors plugin loading and look-ups raise."""


class DuplicateNameError(PluginError):
    pass


class UnknownNameError(PluginError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


@dataclass
class Entry:
    """One registration: ``name`` -> ``target`` from plugin ``plugin`` of ``distribution``."""

    name: str
    target: Any  # the object, or an import path "module:attribute" resolved on first use
    plugin: str
    distribution: str
    version: str
    description: str = ""
    options: Any = None  # a dataclass of option() fields (or an import path to one), or None
    # Later registrations of the same name (the newcomers); while any exists the name is unusable.
    contested_by: list[Entry] = field(default_factory=list, repr=False)
    _resolved: Any = field(default=None, repr=False)

    @property
    def origin(self) -> str:
        """``"distribution version"``, as messages name where something comes from."""
        return f"{self.distribution} {self.version}".strip()

    def load(self) -> Any:
        """The registered object, imported on first use when it was registered by import path."""
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


def duplicate_message(kind: str, first: Entry, newcomer: Entry) -> str:
    return (f"{kind} {first.name!r} is registered twice: first by plugin {first.plugin!r} ({first.origin}), "
            f"then by plugin {newcomer.plugin!r} ({newcomer.origin}); the name is unusable until one goes: "
            f"disable the newcomer with MEGA_DISABLE_PLUGINS={newcomer.plugin} "
            f"(or pip uninstall {newcomer.distribution})")


class Registry:
    """Everything registered of one kind, e.g. ``Registry("tokenizer")``.

    ``failed`` returns the plugins that failed to load: a name none of the others registered may
    be theirs, so the error for an unknown name says so (what a user meets first, where it bites).
    """

    def __init__(self, kind: str, failed: Callable[[], list[FailedPlugin]] = list):
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._failed = failed

    def add(self, entry: Entry) -> None:
        """Register ``entry``; a name already taken keeps its first registration, is marked
        contested (never silently one of them) and :class:`DuplicateNameError` names both."""
        existing = self._entries.get(entry.name)
        if existing is not None:
            existing.contested_by.append(entry)
            raise DuplicateNameError(duplicate_message(self.kind, existing, entry))
        self._entries[entry.name] = entry

    def entry(self, name: str) -> Entry:
        """The registration of ``name``; raises for a contested or unknown name."""
        entry = self._entries.get(name)
        if entry is None:
            raise UnknownNameError(self._unknown_message(name))
        if entry.contested_by:
            raise DuplicateNameError(duplicate_message(self.kind, entry, entry.contested_by[0]))
        return entry

    def get(self, name: str) -> Any:
        """The registered object (imported now if it was registered by import path)."""
        entry = self.entry(name)
        try:
            return entry.load()
        except Exception as error:
            failure = FailedPlugin.from_error(entry.plugin, entry.distribution, entry.version, error)
            raise PluginError(f"{self.kind} {name!r}: {failure_line(failure)}") from error

    def made_for(self, run_config: Any, skip_failed: bool = False) -> list[tuple[str, Any]]:
        """``(name, factory(run_config))`` of every registered factory, by name, but those that
        return None (not wanted for this run). A factory that cannot be loaded raises
        :class:`PluginError` naming its plugin, unless ``skip_failed``."""
        made = []
        for name in self.names():
            try:
                factory = self.get(name)
            except PluginError:
                if skip_failed:
                    continue
                raise
            obj = factory(run_config)
            if obj is not None:
                made.append((name, obj))
        return made

    def names(self) -> list[str]:
        """Every registered name, contested ones included (:meth:`contested` says which)."""
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        """The first registration of every name, sorted by name (``contested_by`` the others)."""
        return [self._entries[name] for name in self.names()]

    def contested(self) -> list[str]:
        """The names two plugins registered: unusable until one of them is disabled."""
        return [name for name in self.names() if self._entries[name].contested_by]

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _unknown_message(self, name: str) -> str:
        message = f"no {self.kind} {name!r}"
        failed = self._failed()
        if failed:
            # The likeliest reason a name is missing: the plugin that provides it did not load.
            message += "; " + "; ".join(failure_line(f) for f in failed) + f" (it may provide {name!r})"
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
