"""A plugin whose callback raises in the middle of a run: in on_step_end of the iteration that
MEGA_TEST_RAISE_AT names (without it, the callback takes no part, so other tests train as usual)."""

import os

from mega.core.plugins import hookimpl


class RaisesAtOneStep:
    def __init__(self, iteration: int):
        self.iteration = iteration

    @hookimpl
    def on_step_end(self, iteration):
        if iteration == self.iteration:
            raise ZeroDivisionError(f"the step counter divided by zero at {iteration}")

    @hookimpl
    def on_train_end(self, run):
        raise AssertionError("a listener that raised takes no further part: this must not run")


def raises_at_one_step(run_config):
    at = os.environ.get("MEGA_TEST_RAISE_AT")
    return RaisesAtOneStep(int(at)) if at else None


@hookimpl
def register_callbacks(register):
    register("raises-at-one-step", raises_at_one_step)
