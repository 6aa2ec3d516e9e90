"""Per-run event dispatch: the training loop and schedules fire, callbacks listen."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pluggy

from mega.core.plugins import hookspecs


class Events:
    """The event hooks of one run.

    ``events.hook.on_step_end(run=..., iteration=..., metrics=...)`` calls every listener that
    implements it. With no listeners a call costs a few microseconds, so schedules fire events
    unconditionally.
    """

    def __init__(self, listeners: Iterable[Any] = ()):
        self._manager = pluggy.PluginManager(hookspecs.PROJECT)
        self._manager.add_hookspecs(hookspecs.EventSpecs)
        for listener in listeners:
            self.add(listener)

    @property
    def hook(self):
        return self._manager.hook

    def add(self, listener: Any) -> None:
        self._manager.register(listener)

    def listeners(self) -> list[Any]:
        return list(self._manager.get_plugins())

    @classmethod
    def from_callbacks(cls, plugins, run_config: Any) -> Events:
        """Instantiate every registered callback factory that wants to take part in this run."""
        listeners = []
        for name in plugins.callbacks.names():
            listener = plugins.callbacks.get(name)(run_config)
            if listener is not None:
                listeners.append(listener)
        return cls(listeners)
