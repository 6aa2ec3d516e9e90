"""Flags and TOML generated from the config dataclasses."""

from __future__ import annotations

import argparse

import pytest

from mega.core.config import ConfigError, add_section, flag_reference, parse
from mega.core.parallel import ParallelConfig
from mega.train.config import CheckpointConfig, DataConfig, OptimizerConfig, TrainingConfig

SECTIONS = {
    "training": TrainingConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
}


class ParserExit(Exception):
    pass


class RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise ParserExit(message)


def make_parser():
    parser = RaisingParser(prog="mega train")
    parser.add_argument("--config")
    for name, cls in SECTIONS.items():
        add_section(parser, name, cls)
    return parser


def run(argv):
    return parse(argv, SECTIONS, make_parser())


def test_megatron_flags_fill_the_sections():
    configs = run([
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--micro-batch-size", "4",
        "--lr", "1e-3", "--lr-decay-style", "linear", "--data-path", "0.3", "a", "0.7", "b",
        "--no-load-optim", "--use-mcore-models",
    ])
    assert configs["parallel"] == ParallelConfig(tp=2, sequence_parallel=True)
    assert configs["training"].micro_batch_size == 4
    assert configs["optimizer"].lr == 1e-3 and configs["optimizer"].lr_decay_style == "linear"
    assert configs["data"].data_path == ["0.3", "a", "0.7", "b"]
    assert configs["checkpoint"].load_optim is False and configs["checkpoint"].load_rng is True


def test_toml_then_flags_override(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[training]\nmicro_batch_size = 8\ntrain_iters = 7\n[parallel]\ntp = 2\n')
    configs = run(["--config", str(path), "--train-iters", "9"])
    assert configs["training"].micro_batch_size == 8
    assert configs["training"].train_iters == 9
    assert configs["parallel"].tp == 2


def test_unknown_flag_suggests_the_closest():
    with pytest.raises(ParserExit, match="unknown flag --tensor-parallel-size; did you mean --tensor-model-parallel-size"):
        run(["--tensor-parallel-size", "2"])


def test_bad_choice_and_bad_values_name_the_flag():
    with pytest.raises(ParserExit, match="--lr-decay-style: invalid choice: 'step'"):
        run(["--lr-decay-style", "step"])
    with pytest.raises(ConfigError, match="--micro-batch-size must be positive, got 0"):
        run(["--micro-batch-size", "0"])


@pytest.mark.parametrize(
    "text,message",
    [
        ("[training]\nmicro_batch = 2\n", "unknown key 'micro_batch' in \\[training\\]; did you mean micro_batch_size"),
        ("[trainng]\n", "unknown section \\[trainng\\]; did you mean training"),
        ("[training]\ntrain_iters = 'ten'\n", "\\[training\\] train_iters = 'ten' is not a valid int"),
        ("[training\n", "invalid TOML"),
    ],
)
def test_toml_errors_name_file_section_and_key(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        run(["--config", str(path)])
    assert str(path) in str(pytest.raises(ConfigError, run, ["--config", str(path)]).value)


def test_flag_reference_lists_every_field_once():
    table = flag_reference(SECTIONS)
    assert table.count("`--tensor-model-parallel-size`") == 1
    assert "`--no-load-optim`" in table and "`--lr-decay-style`" in table
