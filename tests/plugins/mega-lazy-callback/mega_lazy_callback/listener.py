"""Imported only when the callback is used; its dependency is missing."""

import mega_lazy_callback_missing_dependency  # noqa: F401


def make_listener(run_config):
    return None
