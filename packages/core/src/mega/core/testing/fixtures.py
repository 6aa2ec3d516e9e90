"""pytest fixtures; enable with ``pytest_plugins = ["mega.core.testing.fixtures"]`` in a conftest."""

from __future__ import annotations

import pytest

from mega.core.testing.distributed import Worlds


@pytest.fixture(scope="module")
def worlds():
    """Multi-rank worlds shared by the tests of one module: ``worlds.run(4, fn, *args)``."""
    cache = Worlds()
    yield cache
    cache.close()
