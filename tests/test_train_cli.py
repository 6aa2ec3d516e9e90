"""`mega train`'s command line: Megatron's flags, clear errors for what cannot run here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mega.train.command import main

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "64", "--train-iters", "2", "--mock-data"]


def error_of(argv, capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--fp8-hybrid", "--fp8-amax-compute-algo", "max", "--fp8-amax-history-len", "1024"],
         "--fp8-hybrid needs NVIDIA Transformer Engine on a GPU"),
        (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine needs NVIDIA Transformer Engine"),
        (["--tp-comm-overlap"], "--tp-comm-overlap needs NVIDIA Transformer Engine"),
        (["--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
          "--moe-aux-loss-coeff", "0.01", "--moe-grouped-gemm"], "--num-experts (mixture of experts) needs an MoE model family"),
        (["--use-flash-attn"], "--use-flash-attn needs the flash-attn kernel plugin"),
        (["--cpu-optimizer"], "--cpu-optimizer: optimizer offloading is not available"),
        (["--micro-batch-size", "2", "--global-batch-size", "7"],
         "--global-batch-size 7 is not divisible by --micro-batch-size 2 x data-parallel size 1 = 2"),
        (["--tensor-model-parallel-size", "2"], "tp*cp*pp = 2*1*1 = 2 is larger than the world size 1"),
        (["--gradient-accumulation-steps", "3", "--global-batch-size", "4"],
         "--gradient-accumulation-steps 3 disagrees with --global-batch-size 4"),
        (["--model-family", "gtp"], "no model 'gtp'; did you mean gpt"),
        (["--num-query-groups", "3"], "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    ],
)
def test_what_cannot_run_fails_naming_the_flag(argv, message, capsys):
    assert message in error_of(TINY + argv, capsys)


def test_no_data_says_how_to_get_some(capsys):
    argv = [word for word in TINY if word != "--mock-data"]
    assert "give --data-path PREFIX (see `mega preprocess`) or --mock-data" in error_of(argv, capsys)


def test_unknown_flag_suggests_the_closest(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(TINY + ["--tensor-parallel-size", "2"])
    assert exit_info.value.code == 2
    assert "unknown flag --tensor-parallel-size; did you mean --tensor-model-parallel-size" in capsys.readouterr().err


def test_abbreviated_flags_are_refused_in_one_line(capsys):
    # Megatron's parser sets allow_abbrev=False; argparse's default accepted the prefix silently.
    with pytest.raises(SystemExit) as exit_info:
        main(TINY + ["--lr-decay-styl", "cosine"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["mega train: error: unknown flag --lr-decay-styl; did you mean --lr-decay-style, "
                                "--lr-decay-iters?", "see `mega train --help`"]  # not 80 lines of usage first


def test_help_lists_megatron_flags_by_section(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for flag in ["--tensor-model-parallel-size", "--num-layers", "--swiglu", "--lr-decay-style", "--data-path",
                 "--no-load-optim", "--pipeline-timeline", "--nproc-per-node", "--config"]:
        assert flag in out
    assert "model (gpt family):" in out and "optimizer:" in out


def test_seed_gpt_script_flags_train_scaled_down(capsys):
    # Workflow 1 of the Megatron-Core skill seed, at tiny sizes (--transformer-impl local: no TE here).
    argv = [
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
        "--sequence-parallel", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "3e-4", "--train-iters", "3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--use-mcore-models", "--transformer-impl", "local",
        "--mock-data", "--vocab-size", "64", "--eval-iters", "0", "--log-interval", "1",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(" iteration")]
    assert len(lines) == 3 and "lm loss:" in lines[-1] and "global batch size:     4" in lines[-1]
    assert "setting global batch size" not in out  # given, so not derived


def test_a_derived_global_batch_size_is_announced(capsys):
    # Megatron's default (micro-batch x data-parallel size) differs between layouts: say so.
    assert main([*TINY, "--train-iters", "1", "--eval-iters", "0"]) == 0
    assert (" setting global batch size to 1 (--micro-batch-size 1 x data-parallel size 1; give --global-batch-size"
            in capsys.readouterr().out)


def test_seed_llama_script_flags_train_scaled_down(capsys):
    # The LLaMA recipe of the MLOps seed (GQA, SwiGLU, recompute, overlap flags, bf16), at tiny sizes.
    argv = [
        "--model-family", "llama", "--seq-length", "16", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--swiglu",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--recompute-activations", "--overlap-grad-reduce",
        "--overlap-param-gather", "--use-distributed-optimizer", "--bf16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "2", "--mock-data", "--vocab-size", "64",
        "--eval-iters", "0", "--log-interval", "1",
    ]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(" iteration")]
    assert len(lines) == 2 and "number of nan iterations:   0" in lines[-1]


def test_recompute_activations_means_selective():
    from mega.train.command import parse_run
    from mega.train.run_config import derive

    run, _ = parse_run(["--recompute-activations", "--mock-data"])
    run, _ = derive(run, world_size=1)
    assert run.model.recompute_granularity == "selective"


def test_flag_reference_page_is_current():
    from pathlib import Path

    from mega.train.command import flag_reference_markdown

    page = Path(__file__).resolve().parents[1] / "docs" / "training-flags.md"
    assert page.read_text(encoding="utf-8") == flag_reference_markdown(), (
        "docs/training-flags.md is stale: regenerate it with `mega train --flag-reference > docs/training-flags.md`"
    )


def test_fp16_overflowing_steps_are_skipped_and_counted(capsys):
    # Megatron's initial loss scale 2**32 overflows fp16 gradients: those steps are skipped, the
    # scale backs off (hysteresis 2), and the log line counts them.
    argv = TINY + ["--fp16", "--micro-batch-size", "2", "--global-batch-size", "2", "--log-interval", "1",
                   "--train-iters", "4", "--eval-iters", "0"]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(" iteration")]
    skipped = [int(line.split("number of skipped iterations:")[1].split("|")[0]) for line in lines]
    scales = [float(line.split("loss scale:")[1].split("|")[0]) for line in lines]
    assert skipped[-1] >= 2 and skipped == sorted(skipped)
    assert scales[0] == 2.0**32 and scales[-1] < scales[0]


def test_help_without_a_model_family_installed_still_helps():
    # A core-only install (here: mega-models disabled) once failed `mega train --help` with "no model 'gpt'".
    env = {**os.environ, "MEGA_DISABLE_PLUGINS": "models"}
    shown = subprocess.run([sys.executable, "-m", "mega.core.cli.main", "train", "--help"], env=env,
                           capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert "--tensor-model-parallel-size" in shown.stdout and "--hidden-size HIDDEN" not in shown.stdout
    assert "install mega-models (pip install -c constraints.txt -e packages/models" in shown.stdout
    refused = subprocess.run([sys.executable, "-m", "mega.core.cli.main", "train", "--mock-data"], env=env,
                             capture_output=True, text=True)
    assert refused.returncode == 2
    assert refused.stderr == ("mega train: error: no model family is installed ('gpt' was asked for): "
                              "install mega-models (pip install -c constraints.txt -e packages/models, from the mega repository)\n")
