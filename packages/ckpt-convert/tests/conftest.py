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


@pytest.fixture(scope="module")
def world():
    """A 2-rank gloo world for megatron-core's side of the Megatron-LM checkpoint tests (one per
    module: megatron-core's writer state is per process)."""
    pytest.importorskip("megatron.core")
    import megatron_reference

    from mega.testing import DistributedWorld

    with DistributedWorld(2, timeout_s=600) as started:
        yield started
        started.run(megatron_reference.leave)
