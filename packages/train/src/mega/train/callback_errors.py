"""A plugin's callback that raises during a run: the error names the plugin, the hook, the exception
and its message, and ``mega train`` ends with its own exit code (:data:`CALLBACK_EXIT_CODE`; 2 is
for bad input, and a callback's crash is not the user's input).

Each listener a plugin's callback factory made is registered behind a :class:`GuardedListener`:
the same hook implementations, each calling the listener's own and turning an exception into
:class:`CallbackError` (the original is its ``__cause__``, its traceback kept). A listener that
raised takes no further part in the run, so its ``on_train_end`` cannot hide the first error.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

from mega.core.plugins import Events
from mega.core.plugins.failures import describe, format_traceback
from mega.core.plugins.manager import CORE_PLUGIN
from mega.core.plugins.registry import PluginError

# `mega train`'s exit code when a plugin's callback raised (0 done, 2 bad input, 3 a collective
# timed out; docs/reliability.md lists them all).
CALLBACK_EXIT_CODE = 4


@dataclass(frozen=True)
class CallbackOrigin:
    """Where a listener comes from: the callback's registered name and its plugin."""

    callback: str
    plugin: str
    distribution: str
    version: str

    @classmethod
    def of(cls, entry) -> CallbackOrigin:
        return cls(entry.name, entry.plugin, entry.distribution, entry.version)


class CallbackError(PluginError):
    """``plugin P (dist V): callback 'c' raised in on_step_end at iteration 2: RuntimeError: ...``"""

    def __init__(self, origin: CallbackOrigin, hook: str, error: Exception, iteration: int | None):
        self.origin, self.hook, self.error, self.iteration = origin, hook, error, iteration
        where = f" at iteration {iteration}" if iteration is not None else ""
        super().__init__(f"plugin {origin.plugin} ({f'{origin.distribution} {origin.version}'.strip()}): callback "
                         f"{origin.callback!r} raised in {hook}{where}: {describe(error)}")

    @property
    def traceback(self) -> str:
        return format_traceback(self.error)


class GuardedListener:
    """``listener``'s hook implementations, each raising :class:`CallbackError` for what it raises;
    ``on_error(guard)`` is called first (the events then drop this listener)."""

    def __init__(self, listener: Any, origin: CallbackOrigin, implementations: dict[str, Any], on_error,
                 unguarded: set[str] = frozenset()):
        self.listener = listener
        for hook, method in implementations.items():
            setattr(self, hook, method if hook in unguarded else self._guard(hook, method, origin, on_error))

    def _guard(self, hook: str, method, origin: CallbackOrigin, on_error):
        names = list(inspect.signature(method).parameters)  # pluggy passes them by position

        @functools.wraps(method)  # the same signature and hookimpl marker: pluggy sees the listener's
        def call(*args):
            try:
                return method(*args)
            except Exception as error:
                on_error(self)
                raise CallbackError(origin, hook, error, _iteration(dict(zip(names, args, strict=False)))) from error
        return call


def _iteration(arguments: dict) -> int | None:
    if "iteration" in arguments:
        return arguments["iteration"]
    return getattr(arguments.get("run"), "iteration", None)


def events_from_callbacks(plugins, run_config: Any) -> Events:
    """The run's events: every registered callback factory that wants to take part in this run,
    each plugin's listener behind a :class:`GuardedListener`.

    A callback that cannot be loaded raises :class:`PluginError` naming its plugin, unless the
    run was asked to skip failed plugins (``--skip-failed-plugins``; mega train has warned)."""
    training = getattr(run_config, "training", None)
    skip_failed = bool(getattr(training, "skip_failed_plugins", False))
    events = Events()
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
            add_guarded(events, listener, origin)
    return events


def add_guarded(events: Events, listener: Any, origin: CallbackOrigin) -> None:
    """Register a plugin's ``listener`` behind a guard whose errors name the plugin and the hook."""
    # The core's own callbacks are mega itself: their errors keep their own reports.
    if origin.plugin == CORE_PLUGIN:
        events.add(listener)
        return
    options = events.hook_options(listener)
    implementations = {name: getattr(listener, name) for name in options}
    # A wrapper (a generator around the others) is left as it is: guarding it would unmake it.
    wrappers = {name for name, opts in options.items() if opts.get("wrapper") or opts.get("hookwrapper")}
    events.add(GuardedListener(listener, origin, implementations, events.remove, wrappers))
