"""Discovering plugins (entry-point group ``mega``) and collecting what they register."""

from __future__ import annotations

import functools
import importlib.metadata
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from mega.core.plugins import hookspecs
from mega.core.plugins.failures import describe, format_traceback
from mega.core.plugins.registry import DuplicateNameError, Entry, Registry

ENTRY_POINT_GROUP = "mega"
CORE_PLUGIN = "core"  # always loaded: the CLI's own commands live in it

# Registration hook name -> registry kind (singular, as it reads in error messages).
KINDS = {
    "register_models": "model",
    "register_tokenizers": "tokenizer",
    "register_datasets": "dataset",
    "register_checkpoint_formats": "checkpoint format",
    "register_kernel_backends": "kernel backend",
    "register_optimizers": "optimizer",
    "register_commands": "command",
    "register_rewards": "reward",
    "register_callbacks": "callback",
    "register_setup_passes": "setup pass",
}


@dataclass
class PluginInfo:
    """One plugin as ``mega plugins`` lists it. ``error``: it failed to load (import or hook);
    ``duplicates``: names it registered that an earlier plugin already had (it is the newcomer)."""

    name: str
    distribution: str
    version: str
    registered: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None
    traceback: str = ""
    duplicates: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "registered": self.registered,
            "error": self.error,
            "duplicates": self.duplicates,
        }


@dataclass
class _Candidate:
    name: str
    distribution: str
    version: str
    load: Any  # () -> plugin module or object
    installed_at: float = 0.0  # when the distribution was installed: the newcomer registers last


class Plugins:
    """The loaded plugins and one :class:`Registry` per kind of contribution."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs.RegistrationSpecs)
        self.registries = {kind: Registry(kind, self.failed) for kind in KINDS.values()}
        self.infos: list[PluginInfo] = []
        self.disabled: list[str] = []

    # The registries by the names code reads best with.
    @property
    def models(self) -> Registry:
        return self.registries["model"]

    @property
    def tokenizers(self) -> Registry:
        return self.registries["tokenizer"]

    @property
    def datasets(self) -> Registry:
        return self.registries["dataset"]

    @property
    def checkpoint_formats(self) -> Registry:
        return self.registries["checkpoint format"]

    @property
    def kernel_backends(self) -> Registry:
        return self.registries["kernel backend"]

    @property
    def optimizers(self) -> Registry:
        return self.registries["optimizer"]

    @property
    def commands(self) -> Registry:
        return self.registries["command"]

    @property
    def rewards(self) -> Registry:
        return self.registries["reward"]

    @property
    def callbacks(self) -> Registry:
        return self.registries["callback"]

    @property
    def setup_passes(self) -> Registry:
        return self.registries["setup pass"]

    def add(self, plugin: Any, name: str, distribution: str = "(local)", version: str = "") -> PluginInfo:
        """Register one plugin object or module and collect what it registers.

        A plugin whose hooks fail is recorded with its error instead of raising, so one broken
        plugin never takes the CLI down. A name another plugin registered before is recorded in
        this (the newcomer's) ``duplicates``; the contested name then raises
        :class:`DuplicateNameError` wherever it is looked up, and nothing else is affected.
        """
        info = PluginInfo(name, distribution, version)
        self.infos.append(info)
        self.manager.register(plugin, name=name)
        for hook_name, kind in KINDS.items():
            for impl in getattr(self.manager.hook, hook_name).get_hookimpls():
                if impl.plugin_name != name:
                    continue
                registered: list[str] = []

                def register(entry_name: str, obj: Any, description: str = "", *, options: Any = None,
                             _kind=kind, _acc=registered):
                    entry = Entry(entry_name, obj, name, distribution, version, description, options)
                    try:
                        self.registries[_kind].add(entry)
                    except DuplicateNameError as error:
                        info.duplicates.append(str(error))
                    _acc.append(entry_name)

                try:
                    impl.function(register=register)
                except Exception as error:
                    info.error = "; ".join(filter(None, [info.error, f"{hook_name} failed: {describe(error)}"]))
                    info.traceback += format_traceback(error)
                if registered:
                    info.registered[kind] = registered
        return info

    def add_failed(self, name: str, distribution: str, version: str, error: BaseException) -> None:
        self.infos.append(PluginInfo(name, distribution, version, error=describe(error),
                                     traceback=format_traceback(error)))

    def failed(self) -> list[PluginInfo]:
        """The plugins that failed to load (their module or one of their hooks raised)."""
        return [info for info in self.infos if info.error]

    def contested(self) -> list[PluginInfo]:
        """The plugins that registered a name an earlier one had (the newcomers)."""
        return [info for info in self.infos if info.duplicates]


def _entry_point_candidates() -> list[_Candidate]:
    candidates = []
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = entry_point.dist
        candidates.append(
            _Candidate(
                name=entry_point.name,
                distribution=dist.metadata["Name"] if dist else "(unknown)",
                version=dist.version if dist else "",
                load=entry_point.load,
                installed_at=_installed_at(dist),
            )
        )
    # Core first, then in the order the distributions were installed (then by name): of two
    # registrations of one name the second is the newcomer's, which is the one to mark.
    return sorted(candidates, key=lambda c: (c.name != CORE_PLUGIN, c.installed_at, c.name))


def _installed_at(dist) -> float:
    """When ``dist`` was installed: the modification time of its metadata directory (pip writes
    it last). importlib.metadata has no public accessor for the directory; 0 when unknown."""
    path = getattr(dist, "_path", None)
    try:
        return path.stat().st_mtime if path is not None else 0.0
    except OSError:
        return 0.0


def _names_from_env(value: str | None) -> set[str] | None:
    if value is None:
        return None
    return {part.strip() for part in value.split(",") if part.strip()}


def load_plugins(
    environ: dict[str, str] | None = None,
    extra: Iterable[tuple[str, Any]] = (),
) -> Plugins:
    """Load every installed plugin, honouring ``MEGA_LOAD_PLUGINS`` / ``MEGA_DISABLE_PLUGINS``.

    ``MEGA_LOAD_PLUGINS=a,b`` loads only those (and the core); ``MEGA_DISABLE_PLUGINS=a,b``
    skips those. ``extra`` adds (name, plugin) pairs, as tests and embedding programs do.
    """
    environ = os.environ if environ is None else environ
    only = _names_from_env(environ.get("MEGA_LOAD_PLUGINS"))
    disabled = _names_from_env(environ.get("MEGA_DISABLE_PLUGINS")) or set()

    plugins = Plugins()
    for candidate in _entry_point_candidates():
        wanted = candidate.name == CORE_PLUGIN or (
            candidate.name not in disabled and (only is None or candidate.name in only)
        )
        if not wanted:
            plugins.disabled.append(candidate.name)
            continue
        try:
            module = candidate.load()
        except Exception as error:
            plugins.add_failed(candidate.name, candidate.distribution, candidate.version, error)
            continue
        plugins.add(module, candidate.name, candidate.distribution, candidate.version)
    for name, plugin in extra:
        plugins.add(plugin, name)
    return plugins


@functools.lru_cache(maxsize=1)
def get_plugins() -> Plugins:
    """The plugins of this process, loaded once (use :func:`load_plugins` for a fresh set)."""
    return load_plugins()
