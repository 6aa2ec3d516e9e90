"""mega-core: parallel groups, collectives, parallel layers, schedules, the training loop,
checkpoints, configuration, the plugin manager and the ``mega`` CLI.

Importing ``mega.core`` is cheap (no torch); import the sub-module you need.
"""

from mega.core.version import __version__

__all__ = ["__version__"]
