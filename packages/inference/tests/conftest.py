"""Fixtures of mega-inference's tests; the models themselves are in tiny_models.py."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import hf_tiny, mega_from_hf  # noqa: E402


@pytest.fixture(scope="session", params=[("gpt2", "gpt"), ("llama", "llama")], ids=["gpt2", "llama"])
def tiny_pair(request):
    """(Hugging Face model, mega model, mega config) with the same weights."""
    hf_model = hf_tiny(request.param[0])
    model, config = mega_from_hf(hf_model, request.param[1])
    return hf_model, model, config
