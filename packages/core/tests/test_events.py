"""Per-run events: listeners implement any subset of hooks and any subset of arguments."""

from mega.core.plugins import Events, hookimpl
from mega.core.plugins.hookspecs import EventSpecs


class Recorder:
    def __init__(self):
        self.calls = []

    @hookimpl
    def on_forward_start(self, microbatch):  # takes only the argument it needs
        self.calls.append(("forward", microbatch))

    @hookimpl
    def on_step_end(self, iteration, metrics):
        self.calls.append(("step", iteration, metrics["loss"]))


def test_events_reach_listeners():
    recorder = Recorder()
    events = Events([recorder])
    events.hook.on_forward_start(microbatch=3, chunk=0)
    events.hook.on_backward_start(microbatch=3, chunk=0)  # nobody listens: fine
    events.hook.on_step_end(run=None, iteration=7, metrics={"loss": 1.5})
    assert recorder.calls == [("forward", 3), ("step", 7, 1.5)]


def test_every_event_hook_is_documented():
    for name in dir(EventSpecs):
        if name.startswith("on_"):
            assert getattr(EventSpecs, name).__doc__, name
