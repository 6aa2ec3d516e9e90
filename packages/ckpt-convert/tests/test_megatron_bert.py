"""Megatron-LM BERT checkpoints against megatron-core's own ``BertModel`` (pre-LN, binary head, tied
output layer): a genuine torch_dist checkpoint (``dist_checkpointing.save`` by a tp 2 gloo world) and
the legacy files of a tp 2 x pp 2 run import as exactly megatron-core's tensors at other layouts;
exports load back (``dist_checkpointing.load``, strict ``load_state_dict`` per stage) with equal
tensors; and the imported model, mega's bert family with ``--bert-pre-layernorm``, computes the
logits megatron-core's own forward computes (run on the CPU).
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

pytest.importorskip("megatron.core")

import megatron_bert_reference as bert_ref  # noqa: E402
from megatron_reference import made_by_megatron_core  # noqa: E402
from test_megatron import _refused, assert_imports_as  # noqa: E402

from mega.ckpt_convert import ConversionError, WriteOptions, convert  # noqa: E402


@pytest.fixture(scope="module")
def made(world, tmp_path_factory):
    """The tp 2 BERT checkpoints megatron-core wrote, and its tp 1 view of the model (the truth)."""
    return made_by_megatron_core(world, tmp_path_factory.mktemp("megatron-bert"), bert_ref.save_bert,
                                 bert_ref.load_bert_torch_dist)


@pytest.mark.parametrize(("checkpoint", "layout"), [("tp2", (1, 1)), ("tp2", (2, 2)), ("legacy", (1, 1))])
def test_bert_import_gives_megatron_cores_tensors(checkpoint, layout, made, tmp_path):
    root, truth = made
    assert_imports_as(root / checkpoint, truth, layout, tmp_path)


def test_bert_exports_load_in_megatron_core(made, world, tmp_path):
    """megatron legacy -> mega -> torch_dist at tp 2 and 1, and -> legacy tp 2 x pp 2: megatron-core
    loads each with the tensors of the original checkpoint."""
    root, _ = made
    convert(root / "legacy", tmp_path / "mega", from_format="megatron", to_format="mega")
    for tp in (2, 1):
        exported = tmp_path / f"tp{tp}"
        convert(tmp_path / "mega", exported, to_format="megatron",
                options=WriteOptions(tensor_parallel_size=tp, megatron_format="torch_dist", iteration=7))
        loaded = world.run(bert_ref.load_bert_torch_dist, tp, str(exported / "iter_0000007"))
        original = world.run(bert_ref.load_bert_torch_dist, tp, str(root / "tp2" / "iter_0000007"))
        for rank in range(2):
            assert loaded[rank].keys() == original[rank].keys()
            for name, tensor in loaded[rank].items():
                assert torch.equal(tensor, original[rank][name]), (tp, rank, name)
    convert(tmp_path / "mega", tmp_path / "legacy", to_format="megatron",
            options=WriteOptions(tensor_parallel_size=2, pipeline_parallel_size=2, megatron_format="legacy",
                                 iteration=7))
    loaded = world.run(bert_ref.load_bert_legacy, 2, 2, str(tmp_path / "legacy"), 7)
    for rank in range(2):
        for stage in range(2):
            original = torch.load(root / "legacy" / "iter_0000007" / f"mp_rank_{rank:02d}_{stage:03d}" /
                                  "model_optim_rng.pt", weights_only=False)["model"]
            for name, tensor in loaded[rank][stage].items():
                assert torch.equal(tensor, original[name]), (rank, stage, name)


def test_the_imported_bert_computes_megatron_cores_logits(made, world, tmp_path):
    from mega.core.build import build_stage
    from mega.core.checkpoint import load_model_weights, read_metadata
    from mega.core.plugins import get_plugins

    root, _ = made
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, bert_ref.VOCAB, (2, 12), generator=generator)
    types = torch.randint(0, 2, (2, 12), generator=generator)
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, 8:] = 0
    logits, binary = world.run(bert_ref.bert_logits, str(root / "tp2" / "iter_0000007"), ids, types, padding)[0]

    convert(root / "tp2", tmp_path / "mega", from_format="megatron", to_format="mega")
    metadata = read_metadata(tmp_path / "mega")
    assert metadata.model_family == "bert" and metadata.model_config["bert_pre_layernorm"]
    family = get_plugins().models.get("bert")
    stage = build_stage(family, family.config_class(**metadata.model_config), init=False)
    load_model_weights(str(tmp_path / "mega"), [stage])
    with torch.no_grad():
        ours = stage.eval()({"text": ids, "types": types, "padding_mask": padding})
    real = padding.bool()  # a padded query attends to nothing in megatron-core, to the real keys here
    torch.testing.assert_close(ours["logits"].transpose(0, 1)[real], logits[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours["binary_logits"], binary, rtol=1e-5, atol=1e-5)


def test_bert_conversions_and_loads(made, tmp_path, capsys):
    """mega train --load reads the directory; Hugging Face's post-LN BERT and mega's pre-LN one are
    different models, so neither converts to the other's format; args that contradict the tensors
    are named."""
    from mega.train.command import main as train_main

    root, _ = made
    flags = ["--mock-data", "--model-family", "bert", "--bert-pre-layernorm", "--num-layers", "4",
             "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128", "--seq-length", "32",
             "--max-position-embeddings", "32", "--vocab-size", str(bert_ref.VOCAB), "--micro-batch-size", "2",
             "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "1", "--eval-iters", "0",
             "--load", str(root / "legacy")]
    assert train_main(flags) == 0
    assert "loaded megatron legacy (--ckpt-format torch) checkpoint" in capsys.readouterr().out

    convert(root / "tp2", tmp_path / "mega", from_format="megatron", to_format="mega")
    with pytest.raises(ConversionError, match="--bert-pre-layernorm"):
        convert(tmp_path / "mega", tmp_path / "hf", to_format="hf")
    post_ln = tmp_path / "post-ln"
    assert train_main([arg for arg in flags if arg != "--bert-pre-layernorm"][:-2] + ["--save", str(post_ln)]) == 0
    capsys.readouterr()
    with pytest.raises(ConversionError, match="post-LN"):
        convert(post_ln, tmp_path / "megatron", to_format="megatron")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "megatron").exists()

    bad = tmp_path / "bad"
    shutil.copytree(root / "tp2", bad)
    common = bad / "iter_0000007" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].bert_binary_head = False
    torch.save(state, common)
    _refused(capsys, tmp_path, bad, "binary_head.weight")
