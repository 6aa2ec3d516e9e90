"""Per-run event dispatch: the training loop and schedules fire, callbacks listen."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import pluggy

from mega.core.plugins import hookspecs
from mega.core.plugins.callback_errors import CallbackError, CallbackOrigin, GuardedListener
from mega.core.plugins.manager import CORE_PLUGIN
from mega.core.plugins.registry import PluginError


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

    def add(self, listener: Any, origin: CallbackOrigin | None = None) -> None:
        """Register ``listener``; with the ``origin`` of a plugin's callback, behind a guard whose
        errors name the plugin and the hook (:mod:`mega.core.plugins.callback_errors`)."""
        # The core's own callbacks (the console, the exit signal, the hang report) are mega itself:
        # their errors (a collective timeout, a bad --tensorboard-dir) keep their own reports.
        if origin is None or origin.plugin == CORE_PLUGIN:
            self._manager.register(listener)
            return
        options = {name: self._manager.parse_hookimpl_opts(listener, name) for name in dir(listener)}
        implementations = {name: getattr(listener, name) for name, opts in options.items() if opts is not None}
        # A wrapper (a generator around the others) is left as it is: guarding it would unmake it.
        wrappers = {name for name, opts in options.items() if opts and (opts.get("wrapper") or opts.get("hookwrapper"))}
        self._manager.register(GuardedListener(listener, origin, implementations, self._manager.unregister, wrappers))

    def listeners(self) -> list[Any]:
        return [getattr(plugin, "listener", plugin) if isinstance(plugin, GuardedListener) else plugin
                for plugin in self._manager.get_plugins()]

    @classmethod
    def from_callbacks(cls, plugins, run_config: Any) -> Events:
        """Instantiate every registered callback factory that wants to take part in this run.

        A callback that cannot be loaded raises :class:`PluginError` naming its plugin, unless the
        run was asked to skip failed plugins (``--skip-failed-plugins``; mega train has warned)."""
        training = getattr(run_config, "training", None)
        skip_failed = bool(getattr(training, "skip_failed_plugins", False))
        events = cls()
        for name in plugins.callbacks.names():
            try:
                factory = plugins.callbacks.get(name)
            except PluginError:
                if skip_failed:
                    continue
                raise
            origin = CallbackOrigin.of(plugins.callbacks.entry(name))
            try:
                listener = factory(run_config)
            except Exception as error:
                if origin.plugin == CORE_PLUGIN:
                    raise
                raise CallbackError(origin, "its factory", error, None) from error
            if listener is not None:
                events.add(listener, origin)
        return events
