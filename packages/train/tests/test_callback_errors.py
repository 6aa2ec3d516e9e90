"""A plugin's callbacks in a run: the factories choose per run, and an error names the plugin and
the hook (CPU; no device involved). Moved from mega-core's test_events.py with the guard."""

from mega.core.plugins import Plugins, hookimpl
from mega.train.callback_errors import events_from_callbacks


class Recorder:
    """A well-behaved listener beside the one that raises: it keeps its place in the run."""

    def __init__(self):
        self.steps = []

    @hookimpl
    def on_step_end(self, iteration):
        self.steps.append(iteration)


def test_callback_factories_choose_per_run():
    class Plugin:
        @hookimpl
        def register_callbacks(self, register):
            register("always", lambda config: Recorder())
            register("never", lambda config: None)

    plugins = Plugins()  # no installed plugins: only this one's callbacks
    plugins.add(Plugin(), "p")
    events = events_from_callbacks(plugins, run_config=None)
    assert [type(listener).__name__ for listener in events.listeners()] == ["Recorder"]


def test_a_plugin_callback_that_raises_names_plugin_hook_and_error_and_takes_no_further_part():
    import pytest

    from mega.train.callback_errors import CallbackError

    class Breaks:
        ended = False

        @hookimpl
        def on_step_end(self, run, iteration):
            raise ZeroDivisionError(f"at {iteration}")

        @hookimpl
        def on_train_end(self, run):
            Breaks.ended = True

        @hookimpl(wrapper=True)
        def on_train_start(self, run):
            return (yield)  # a wrapper stays a wrapper

    class Plugin:
        @hookimpl
        def register_callbacks(self, register):
            register("breaks", lambda config: Breaks())
            register("records", lambda config: Recorder())

    plugins = Plugins()
    plugins.add(Plugin(), "p", "mega-p", "1.0")
    events = events_from_callbacks(plugins, run_config=None)
    assert sorted(type(listener).__name__ for listener in events.listeners()) == ["Breaks", "Recorder"]
    events.hook.on_train_start(run=None)
    with pytest.raises(CallbackError) as caught:
        events.hook.on_step_end(run=None, iteration=2, metrics={"loss": 1.0})
    assert str(caught.value) == ("plugin p (mega-p 1.0): callback 'breaks' raised in on_step_end at iteration 2: "
                                 "ZeroDivisionError: at 2")
    assert isinstance(caught.value.__cause__, ZeroDivisionError) and "raise ZeroDivisionError" in caught.value.traceback
    events.hook.on_train_end(run=None)
    assert not Breaks.ended and [type(listener).__name__ for listener in events.listeners()] == ["Recorder"]
