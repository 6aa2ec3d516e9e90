"""Per-run event dispatch: the training loop and schedules fire, callbacks listen."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
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

    @contextlib.contextmanager
    def forward_context(self, microbatch: int, chunk: int) -> Iterator[None]:
        """Every listener's ``forward_context`` entered around one micro-batch's forward, the
        first registered outermost (pluggy calls the last registered first)."""
        with contextlib.ExitStack() as stack:
            for context in reversed(self.hook.forward_context(microbatch=microbatch, chunk=chunk)):
                stack.enter_context(context)
            yield

    def add(self, listener: Any) -> None:
        self._manager.register(listener)

    def listeners(self) -> list[Any]:
        return list(self._manager.get_plugins())

    @classmethod
    def from_callbacks(cls, plugins, run_config: Any) -> Events:
        """Instantiate every registered callback factory that wants to take part in this run.

        A callback that cannot be loaded raises :class:`PluginError` naming its plugin, unless the
        run was asked to skip failed plugins (``--skip-failed-plugins``; mega train has warned)."""
        training = getattr(run_config, "training", None)
        skip_failed = bool(getattr(training, "skip_failed_plugins", False))
        return cls(listener for _, listener in plugins.callbacks.made_for(run_config, skip_failed))
