"""Before ``mega train`` starts: every plugin that should take part can.

A plugin that failed to load may have registered a callback (a logger, a guard) the user counts
on, and a callback registered by import path fails only when it is imported; both are treated
alike: training stops before it starts, naming them, unless ``--skip-failed-plugins``.
"""

from __future__ import annotations

from mega.core.plugins.failures import failure_line
from mega.core.plugins.registry import PluginError


def plugin_problems(plugins) -> list[str]:
    """One line per failed plugin and per callback that cannot be loaded (failed or contested)."""
    problems = [failure_line(info) for info in plugins.failed()]
    failed_names = {info.name for info in plugins.failed()}
    for entry in plugins.callbacks.entries():
        if entry.plugin in failed_names and not entry.contested_by:
            continue  # its plugin's line says it already
        try:
            plugins.callbacks.get(entry.name)
        except PluginError as error:
            problems.append(str(error))  # "callback 'x': plugin ... failed to load: ..." or the duplicate
    return problems


def check_plugins_for_training(plugins, skip_failed: bool) -> list[str]:
    """Raise :class:`PluginError` naming every problem; with ``skip_failed`` return them as
    warnings instead (the failed callbacks then take no part in the run)."""
    problems = plugin_problems(plugins)
    if problems and not skip_failed:
        raise PluginError("a plugin cannot take part in training: " + "; ".join(problems)
                          + "; fix or disable it (MEGA_DISABLE_PLUGINS=NAME), or pass --skip-failed-plugins")
    return problems
