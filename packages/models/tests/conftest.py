"""Helpers shared by mega-models' tests."""

from __future__ import annotations

import os

import pytest

# Hugging Face models are built from configs; nothing may be downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def relative_error(actual, expected) -> float:
    """max |actual - expected| / max |expected|: "equal within 1e-5 relative" for a whole tensor."""
    expected = expected.double()
    return ((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


@pytest.fixture
def assert_close():
    def check(actual, expected, tolerance=1e-5, what=""):
        assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        error = relative_error(actual, expected)
        assert error <= tolerance, f"{what}: relative error {error:.3g} > {tolerance:g}"
    return check
