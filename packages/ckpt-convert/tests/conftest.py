"""Fixtures of the conversion tests: the tiny Hugging Face models, saved once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_test_models import VARIANTS, make_hf_model, save_hf_model  # noqa: E402


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """variant -> a saved Hugging Face directory (weights, config, tokenizer)."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    return {variant: save_hf_model(make_hf_model(variant), root / variant) for variant in VARIANTS}

