"""A plugin whose module fails to import (a missing dependency): what it would have registered
(a family, a command, a callback...) is unknown, so every point of use names it."""

import mega_broken_missing_dependency  # noqa: F401
