"""A run that loads a checkpoint takes its model from it (issue 53, item 2): family, model config
and tokenizer come from ``--load`` with no architecture flag; a flag that agrees is accepted, one
that would compute another function is named with both values, and each change the table of
docs/finetuning.md allows is accepted. CPU only (gloo, one process); parsing is checked without
training, and one fine-tune runs a step."""

from __future__ import annotations

import dataclasses
import re

import pytest

from mega.core.config import ConfigError
from mega.train.command import main as train_main
from mega.train.run_parser import parse_run

SIZES = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "64", "--seq-length", "16"]
RUN = ["--mock-data", "--micro-batch-size", "2", "--eval-iters", "0", "--log-interval", "1000", "--lr", "1e-3",
       "--train-iters", "1"]
LLAMA = ["--model-family", "llama", "--model-preset", "tiny", *SIZES, "--max-position-embeddings", "16",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "90"]
GPT = ["--model-family", "gpt", "--model-preset", "tiny", *SIZES, "--vocab-size", "90"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A LLaMA (RoPE, a NullTokenizer recorded) and a GPT (a learned position table) checkpoint."""
    root = tmp_path_factory.mktemp("saved")
    for name, flags in {"llama": LLAMA, "gpt": GPT}.items():
        assert train_main([*RUN, *flags, "--save", str(root / name)]) == 0
    return {name: str(root / name) for name in ("llama", "gpt")}


def test_the_checkpoint_gives_family_config_and_tokenizer(saved):
    trained, _ = parse_run([*RUN, *LLAMA])
    # Data files (parsing does not open them) are read with the checkpoint's tokenizer.
    run, family = parse_run(["--data-path", "corpus_text_document", "--load", saved["llama"], "--finetune"])
    assert family.name == "llama" and run.training.model_family == "llama"
    # The NullTokenizer is rebuilt from its own size (90); it gives the model its 91 ids again.
    assert run.model == trained.model
    assert run.data.tokenizer_type == "NullTokenizer"
    assert parse_run(["--mock-data", "--load", saved["llama"]])[0].data.tokenizer_type is None  # nothing to tokenize
    # Megatron's --use-checkpoint-args is accepted, and the TOML [checkpoint] table names --load too.
    assert parse_run(["--mock-data", "--load", saved["llama"], "--use-checkpoint-args"])[0].model == \
        dataclasses.replace(run.model, vocab_size=91)


def test_a_toml_load_gives_the_model(saved, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f'[checkpoint]\nload = "{saved["llama"]}"\nfinetune = true\n')
    run, family = parse_run(["--config", str(config), "--mock-data"])
    assert family.name == "llama" and run.model.position_embedding_type == "rope"


def test_fine_tuning_with_no_architecture_flag(saved, tmp_path, capsys):
    assert train_main([*RUN, "--load", saved["llama"], "--finetune", "--save", str(tmp_path / "tuned")]) == 0
    assert "loaded checkpoint" in capsys.readouterr().out
    tuned, _ = parse_run(["--mock-data", "--load", str(tmp_path / "tuned")])
    assert tuned.model == parse_run(["--mock-data", "--load", saved["llama"]])[0].model


def test_a_flag_that_agrees_is_accepted_one_that_differs_is_named(saved):
    parse_run(["--mock-data", "--load", saved["llama"], "--model-family", "llama", "--num-layers", "2",
               "--normalization", "RMSNorm"])
    with pytest.raises(ConfigError, match=re.escape("num_layers (--num-layers) 2 where this run has 3")):
        parse_run(["--mock-data", "--load", saved["llama"], "--num-layers", "3"])
    with pytest.raises(ConfigError, match="holds a 'llama' model; this run asks for 'gpt'"):
        parse_run(["--mock-data", "--load", saved["llama"], "--model-family", "gpt"])


FIELD = "does not match this model: it was saved with {} \\("
# The table of docs/finetuning.md ("What a run that loads a checkpoint may change"): per row, the
# flags it allows (each accepted), and one change of the row's kind that is refused.
MAY_CHANGE = {
    "sequence length": ("llama", ["--seq-length", "64"], ("gpt", ["--seq-length", "64"], "--seq-length 64 exceeds --max-position-embeddings 16")),
    "position table on RoPE": ("llama", ["--max-position-embeddings", "4096"],
                               ("gpt", ["--max-position-embeddings", "4096"], FIELD.format("max_position_embeddings"))),
    "dropout": ("gpt", ["--hidden-dropout", "0.2", "--attention-dropout", "0.0"],
                ("gpt", ["--norm-epsilon", "1e-6"], FIELD.format("layernorm_epsilon"))),
    "recompute": ("llama", ["--recompute-granularity", "full", "--recompute-method", "block",
                            "--recompute-num-layers", "1"], ("llama", ["--num-layers", "4"], FIELD.format("num_layers"))),
    "kernels and fusions": ("llama", ["--attention-backend", "torch", "--no-bias-swiglu-fusion",
                                      "--cross-entropy-loss-fusion"],
                            ("llama", ["--qk-layernorm"], FIELD.format("qk_layernorm"))),
    "precision": ("llama", ["--bf16"], ("llama", ["--rotary-base", "10000"], FIELD.format("rotary_base"))),
    "parallel layout": ("llama", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--use-distributed-optimizer"],
                        ("llama", ["--num-attention-heads", "8", "--kv-channels", "4"], FIELD.format("num_attention_heads"))),
    "vocabulary padding": ("gpt", ["--make-vocab-size-divisible-by", "64"],
                           ("gpt", ["--vocab-size", "100"], FIELD.format("vocab_size"))),
    "initialisation": ("gpt", ["--init-method-std", "0.01"],
                       ("gpt", ["--untie-embeddings-and-output-weights"], FIELD.format("untie_embeddings_and_output_weights"))),
}


@pytest.mark.parametrize("row", MAY_CHANGE)
def test_what_may_change_on_a_load(saved, row):
    family, allowed, (refused_family, refused, message) = MAY_CHANGE[row]
    parse_run(["--mock-data", "--load", saved[family], *allowed])
    with pytest.raises(ConfigError, match=message):
        parse_run(["--mock-data", "--load", saved[refused_family], *refused])


def test_the_table_in_the_docs_lists_these_rows():
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "finetuning.md").read_text()
    table = page.split("### What a run that loads a checkpoint may change", 1)[1].split("\n\n", 2)[1]
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:]] == list(MAY_CHANGE)
