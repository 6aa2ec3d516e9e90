"""A plugin that loads, but whose callback, registered by import path, fails when imported."""

from mega.core.plugins import hookimpl


@hookimpl
def register_callbacks(register):
    register("lazy-csv", "mega_lazy_callback.listener:make_listener", "fails when imported")
