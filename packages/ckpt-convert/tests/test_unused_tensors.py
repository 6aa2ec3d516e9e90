"""A tensor of a source checkpoint that the conversion does not use is an error naming it, or with
``--allow-unused-tensors`` a warning: megatron-core's own torch_dist and legacy checkpoints of a
GPT with tied embeddings, given an output layer besides (issue 37, item 3)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
pytest.importorskip("megatron.core")

import megatron_reference as ref  # noqa: E402

from mega.ckpt_convert.cli import main as convert_main  # noqa: E402
from mega.core.checkpoint import read_tensors, tensor_shapes  # noqa: E402


@pytest.fixture(scope="module")
def saved(world, tmp_path_factory):
    """megatron-core's tied GPT at tp 2: torch_dist with an extra output layer; legacy files (pp 2)
    as saved, and megatron-core's tp 1 view of the model (the truth)."""
    root = tmp_path_factory.mktemp("unused")
    world.run(ref.save_torch_dist_with_extra_output_layer, "gpt", 2, str(root / "torch_dist" / "iter_0000007"))
    world.run(ref.save_both, "gpt", str(root / "clean" / "iter_0000007"), str(root / "legacy"))
    truth = world.run(ref.load_torch_dist, "gpt", 1, str(root / "clean" / "iter_0000007"))[0]
    return root, truth


def _legacy_with_output_layer(root: Path, tmp_path: Path) -> Path:
    """The legacy tp 2 x pp 2 files with their last stage's output_layer.weight (the tied
    embedding's copy, which megatron-core keeps there) replaced by another tensor."""
    legacy = tmp_path / "legacy"
    for source in (root / "legacy").rglob("*"):
        target = legacy / source.relative_to(root / "legacy")
        if source.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        state = torch.load(source, weights_only=False) if source.suffix == ".pt" else None
        if state is not None and "output_layer.weight" in state["model"]:
            state["model"]["output_layer.weight"] = torch.randn_like(state["model"]["output_layer.weight"])
            torch.save(state, target)
        else:
            target.write_bytes(source.read_bytes())
    return legacy


def _convert(source: Path, output: Path, *flags: str) -> int:
    return convert_main(["--from", "megatron", "--to", "mega", "--input", str(source), "--output", str(output),
                         "--progress", "never", *flags])


def test_extra_output_layer_is_refused_or_left_out_with_a_warning(saved, tmp_path, capsys):
    root, truth = saved
    for source in (root / "torch_dist", _legacy_with_output_layer(root, tmp_path)):
        refused = tmp_path / f"{source.name}-refused"
        assert _convert(source, refused) == 1
        err = capsys.readouterr().err
        assert "output_layer.weight" in err and "--allow-unused-tensors" in err, err
        assert not refused.exists()

        allowed = tmp_path / f"{source.name}-allowed"
        assert _convert(source, allowed, "--allow-unused-tensors") == 0
        err = capsys.readouterr().err
        assert "warning" in err and "output_layer.weight" in err and "left out" in err, err
        names = list(tensor_shapes(allowed))
        assert "output_layer.weight" not in names
        tensors = read_tensors(allowed, names)
        for name in names:  # the model itself converts as megatron-core holds it
            assert torch.equal(tensors[name], truth[name]), name


def test_mega_train_load_honours_allow_unused_tensors(saved, capsys):
    """``mega train --load`` converts a Megatron-LM directory on the fly: the same refusal, and the
    same flag to load it without the extra tensor."""
    from mega.core.training.command import main as train_main

    root, _ = saved
    m = ref.MODELS["gpt"]
    flags = ["--mock-data", "--model-family", "gpt", "--num-layers", str(m["num_layers"]), "--hidden-size", "64",
             "--num-attention-heads", "4", "--ffn-hidden-size", str(m["ffn_hidden_size"]),
             "--seq-length", str(ref.SEQ), "--max-position-embeddings", str(ref.SEQ), "--vocab-size", str(ref.VOCAB),
             "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "1",
             "--eval-iters", "0", "--load", str(root / "torch_dist")]
    assert train_main(flags) != 0
    assert "output_layer.weight" in capsys.readouterr().err
    assert train_main([*flags, "--allow-unused-tensors"]) == 0
    out = capsys.readouterr().out
    assert "loaded megatron torch_dist" in out and "warning" in out and "output_layer.weight" in out, out
