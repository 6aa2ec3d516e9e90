"""`mega train --optimizer muon` at every parallel layout computes what one process computes, and
resumes across layouts exactly (CPU, fp32, gloo; pinned to the CPU so it runs alike on a GPU
machine).

LLaMA (fused QKV with grouped queries, SwiGLU) at tp2 + sp, dp2 with the distributed optimizer,
FSDP2 over dp2 and pp2; Mixtral (grouped experts, orthogonalised per expert, router on AdamW) at
ep2. Newton-Schulz runs in fp32 (``--muon-fp32-matmul-prec highest``): the layouts' gradients
differ from one process's in the last bits, which bf16 iterations would magnify past 1e-5.
"""

from __future__ import annotations

import pytest

from mega.train.testing.training_runs import assert_losses_close, train_each, train_losses

MUON = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "highest", "--muon-use-nesterov",
        "--muon-lr", "2e-2", "--muon-weight-decay", "0.05", "--clip-grad", "0"]
COMMON = [
    "--mock-data", "--model-preset", "tiny", "--num-layers", "2", "--hidden-size", "32", "--seq-length", "16",
    "--vocab-size", "90", "--make-vocab-size-divisible-by", "32", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "0",
    "--log-interval", "100", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", *MUON,
]
LLAMA = [*COMMON, "--model-family", "llama", "--num-query-groups", "2"]
MIXTRAL = [*COMMON, "--model-family", "mixtral", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
           "--num-query-groups", "2", "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall"]
LAYOUTS = {
    "tp2 + sp": [*LLAMA, "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "dp2 distributed optimizer": [*LLAMA, "--use-distributed-optimizer"],
    "fsdp2 dp2": [*LLAMA, "--use-torch-fsdp2"],
    "pp2": [*LLAMA, "--pipeline-model-parallel-size", "2"],
    "mixtral ep2": [*MIXTRAL, "--expert-model-parallel-size", "2"],
}


@pytest.fixture(scope="module")
def one_process():
    return {"llama": train_losses(LLAMA), "mixtral": train_losses(MIXTRAL)}


def test_muon_layouts_match_one_process(worlds, one_process):
    assert one_process["llama"][-1] < one_process["llama"][0], "the tiny model should learn the mock data"
    results = worlds.run(2, train_each, list(LAYOUTS.values()))
    for index, layout in enumerate(LAYOUTS):
        reference = one_process["mixtral" if "mixtral" in layout else "llama"]
        assert results[0][index] == results[1][index], layout
        assert_losses_close(results[0][index], reference, layout)


STOP = 3


def save_then_resume(save_dir: str, first: list[str], second: list[str]) -> list[float]:
    """Train ``first`` to STOP and save; resume ``second`` from there to the end."""
    head = train_losses([*first, "--exit-interval", str(STOP), "--save", save_dir, "--save-interval", str(STOP)])
    tail = train_losses([*second, "--load", save_dir])
    return head + tail


def test_muon_resumes_across_layouts(worlds, tmp_path, one_process):
    """Saved at tp2 + sp, resumed with the distributed optimizer at dp2 (and the reverse): the
    momentum reshards as Adam's moments do, so the losses are one process's."""
    saved_tp = [f"{tmp_path}/tp", LAYOUTS["tp2 + sp"], LAYOUTS["dp2 distributed optimizer"]]
    saved_dp = [f"{tmp_path}/dp", LAYOUTS["dp2 distributed optimizer"], LAYOUTS["fsdp2 dp2"]]
    results = worlds.run(2, _resume_each, [saved_tp, saved_dp])
    for losses, what in zip(results[0], ("tp2 + sp -> dp2 distributed optimizer", "dp2 ZeRO-1 -> fsdp2"),
                            strict=True):
        assert_losses_close(losses, one_process["llama"], what)


def _resume_each(cases: list[list]) -> list[list[float]]:
    return [save_then_resume(*case) for case in cases]


def test_megatron_export_of_muon_state_is_refused_with_the_reason(tmp_path, capsys):
    """Megatron-LM has no distributed-optimizer layout for Muon: the export says so, and the
    weights alone still convert."""
    from mega.ckpt_convert.cli import main

    train_losses([*LLAMA, "--train-iters", "2", "--save", str(tmp_path / "run"), "--save-interval", "2"])
    checkpoint = str(tmp_path / "run" / "iter_0000002")
    args = ["--from", "mega", "--to", "megatron", "--input", checkpoint, "--megatron-format", "torch_dist"]
    assert main([*args, "--output", str(tmp_path / "with"), "--with-optimizer"]) == 1
    error = capsys.readouterr().err
    assert "Muon's state" in error and "no distributed-optimizer layout for Muon" in error, error
    assert not (tmp_path / "with").exists()
    assert main([*args, "--output", str(tmp_path / "weights")]) == 0


QK_CLIP = ["--qk-clip", "--qk-clip-threshold", "0.3", "--qk-clip-alpha", "0.5"]


def test_qk_clip_layouts_match_one_process(worlds, one_process):
    """QK-clip at a threshold the tiny model's logits exceed: it changes the run, and every layout
    clips as one process does (maxima reduced over data-parallel ranks, each tensor rank its heads)."""
    reference = train_losses([*LLAMA, *QK_CLIP])
    assert max(abs(a - b) for a, b in zip(reference, one_process["llama"], strict=True)) > 1e-4, "it should clip"
    layouts = [[*LAYOUTS[name], *QK_CLIP] for name in ("tp2 + sp", "dp2 distributed optimizer", "fsdp2 dp2")]
    results = worlds.run(2, train_each, layouts)
    for losses, what in zip(results[0], ("tp2 + sp", "dp2 ZeRO-1", "fsdp2 dp2"), strict=True):
        assert_losses_close(losses, reference, f"qk-clip {what}")
