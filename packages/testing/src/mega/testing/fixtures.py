"""pytest fixtures; enable with ``pytest_plugins = ["mega.testing.fixtures"]`` in a conftest."""

from __future__ import annotations

import pytest

from mega.testing.distributed import Worlds
from mega.testing.equivalence import max_relative_error


@pytest.fixture(scope="module")
def worlds():
    """Multi-rank worlds shared by the tests of one module: ``worlds.run(4, fn, *args)``."""
    cache = Worlds()
    yield cache
    cache.close()


@pytest.fixture
def assert_close():
    """``assert_close(actual, expected, tolerance=1e-5, what="")``: same shape, and equal within
    ``tolerance`` relative (:func:`~mega.testing.equivalence.max_relative_error`)."""
    def check(actual, expected, tolerance=1e-5, what=""):
        assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        error = max_relative_error(actual, expected)
        assert error <= tolerance, f"{what}: relative error {error:.3g} > {tolerance:g}"
    return check
