"""mega's plugin system: hook specifications, discovery and registries."""

from mega.core.plugins.command import Command
from mega.core.plugins.events import Events
from mega.core.plugins.hookspecs import hookimpl
from mega.core.plugins.manager import PluginInfo, Plugins, get_plugins, load_plugins
from mega.core.plugins.registry import DuplicateNameError, PluginError, Registry, UnknownNameError

__all__ = [
    "Command",
    "DuplicateNameError",
    "Events",
    "PluginError",
    "PluginInfo",
    "Plugins",
    "Registry",
    "UnknownNameError",
    "get_plugins",
    "hookimpl",
    "load_plugins",
]
