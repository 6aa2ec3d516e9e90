"""FP8 training through torchao's float8, with the real library on the CPU (torch._scaled_mm
has a CPU kernel); every test here runs on the CPU, on a machine with a GPU too: training runs
on gloo ranks (a world of one for one process), the layer checks on CPU tensors.

What the numbers are compared with: torchao's own ``Float8Linear`` (mega's FP8 column/row
layers compute its products bit for bit at tp1), the bf16 run (FP8 losses within 2% at every
step), and the one-process FP8 run (every layout).
"""

from __future__ import annotations

import pytest
import torch

from mega.train.testing.training_runs import assert_losses_close, train_each, train_losses

TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "100", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--lr-decay-style", "constant", "--eval-iters", "0", "--log-interval", "1000",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5"]
FAMILIES = {
    "gpt": ["--model-family", "gpt", "--model-preset", "tiny"],
    "llama": ["--model-family", "llama", "--model-preset", "tiny", "--num-query-groups", "2", "--ffn-hidden-size", "64"],
}
# A world's call may take this long: 100 steps on a loaded 2-core machine (the default is 120 s).
LONG_RUN_S = 900
FP8 = {"gpt": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
       "llama": ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"]}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
def test_parallel_layers_compute_torchaos_float8_linear_at_tp1(recipe, fp8_format):
    """CPU. At tp1 mega's FP8 column- and row-parallel layers give torchao's Float8Linear's
    output and gradients exactly (the same casts, scales and _scaled_mm calls), also with the
    weight gradient deferred to a zero-bubble schedule's W step."""
    from mega_torchao.fp8 import float8_config
    from mega_torchao.layers import Float8ColumnParallelLinear, Float8DeferringLinear, Float8RowParallelLinear
    from torchao.float8.float8_linear import Float8Linear

    from mega.core.parallel.groups import Group
    from mega.core.parallel.layers import ColumnParallelLinear, RowParallelLinear
    from mega.core.parallel.weight_grad_split import deferring_weight_grads, run_weight_grads

    config = float8_config(fp8_format, recipe)
    torch.manual_seed(0)
    reference = torch.nn.Linear(64, 48, dtype=torch.bfloat16)
    one = Group("tp", (0,), 0, None)
    for parallel, fp8_class in ((ColumnParallelLinear, Float8ColumnParallelLinear),
                                (RowParallelLinear, Float8RowParallelLinear), (None, Float8DeferringLinear)):
        if parallel is None:  # one process's nn.Linear under a zero-bubble schedule
            layer = fp8_class.from_linear(torch.nn.Linear(64, 48, dtype=torch.bfloat16), config)
            with torch.no_grad():
                layer.weight.copy_(reference.weight), layer.bias.copy_(reference.bias)
        else:
            layer = fp8_class.from_parallel(parallel.from_linear(reference, one), config)
        theirs = Float8Linear.from_float(torch.nn.Linear(64, 48, dtype=torch.bfloat16), config)
        with torch.no_grad():
            theirs.weight.copy_(reference.weight), theirs.bias.copy_(reference.bias)
        x = torch.randn(4, 3, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
        grad = torch.randn(4, 3, 48, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
        mine_x, their_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = layer(mine_x), theirs(their_x)
        out.backward(grad), expected.backward(grad)
        assert torch.equal(out, expected), fp8_class.__name__
        assert torch.equal(mine_x.grad, their_x.grad) and torch.equal(layer.weight.grad, theirs.weight.grad)
        assert not torch.equal(out, reference(x))  # really FP8
        layer.weight.grad = layer.bias.grad = None
        pending = []
        with deferring_weight_grads(pending):
            split = layer(x.clone().requires_grad_())
        split.backward(grad)
        assert layer.weight.grad is None and len(pending) == 1  # B: the input gradient (and the bias's)
        run_weight_grads(pending)
        assert torch.equal(layer.weight.grad, theirs.weight.grad) and torch.equal(layer.bias.grad, theirs.bias.grad)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_models_train_50_steps_in_fp8_within_2_percent_of_bf16(worlds, family):
    """CPU (a gloo world of one). Largest gap measured: 0.11% (GPT, tensorwise hybrid) and
    0.05% (LLaMA, rowwise e4m3) of the bf16 loss."""
    argv = TINY + FAMILIES[family] + ["--bf16", "--train-iters", "50", "--global-batch-size", "2"]
    bf16, fp8 = worlds.run(1, train_each, [argv, argv + FP8[family]], timeout_s=LONG_RUN_S)[0]
    gaps = [abs(a - b) / b for a, b in zip(fp8, bf16, strict=True)]
    assert max(gaps) < 0.02, f"largest gap {max(gaps):.2%} at step {gaps.index(max(gaps)) + 1}"
    assert fp8 != bf16 and fp8[-1] < fp8[0] - 0.5


LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    # Zero bubble: the FP8 weight gradients wait for W (one process's linears: Float8DeferringLinear).
    "pp2-zb-h1": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"],
    "dp2-distributed-optimizer": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
    "dp2-fsdp2": ["--use-torch-fsdp2"],
    "tp2-recompute": ["--tensor-model-parallel-size", "2", "--recompute-granularity", "full",
                      "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "cp2": ["--context-parallel-size", "2"],
}
# tp splits a row-parallel product's fp32 sum over the ranks (another order), and an element on
# an FP8 rounding boundary downstream may then round the other way: measured 0 (GPT, tensorwise
# hybrid: equal) and 8.8e-5 (LLaMA, rowwise e4m3) of the loss; 5e-4 leaves room for other CPUs'
# summation orders. cp2: each rank's tensorwise scale covers its half of the sequence and
# attention merges two partial softmaxes (measured 6.6e-5 GPT, 3.7e-5 LLaMA). pp and dp (DDP, the
# distributed optimizer, FSDP2) compute the same products in the same order (measured 0), zero
# bubble too (the same products, W later).
LAYOUT_TOLERANCE = {"tp2-sp": 5e-4, "tp2-recompute": 5e-4, "pp2-zb-h1": 1e-6, "dp2-distributed-optimizer": 1e-6,
                    "dp2-fsdp2": 1e-6, "cp2": 5e-4}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_layout_equals_the_one_process_fp8_run(worlds, family):
    """gloo ranks on the CPU (the reference too: a world of one). fp32 parameters, FP8 products;
    the amaxes of split operands are reduced over the tensor group, so tp scales as one process."""
    base = TINY + FAMILIES[family] + FP8[family] + ["--train-iters", "3", "--num-layers", "4"]
    reference = worlds.run(1, train_losses, base, timeout_s=LONG_RUN_S)[0]
    results = worlds.run(2, train_each, [base + extra for extra in LAYOUTS.values()], timeout_s=LONG_RUN_S)
    for index, layout in enumerate(LAYOUTS):
        assert results[0][index] == results[1][index], layout
        assert_losses_close(results[0][index], reference, layout, LAYOUT_TOLERANCE[layout])


def test_mixtral_at_ep2_equals_the_one_process_fp8_run(worlds):
    """gloo ranks on the CPU. Attention's products in FP8, the router in fp32 as Megatron keeps
    it, the grouped experts in their own precision (the pass swaps linear layers; torchao's FP8
    grouped GEMM is a CUDA prototype). Expert parallelism moves tokens, not sums: equal losses."""
    base = TINY + ["--model-family", "mixtral", "--model-preset", "tiny", "--num-query-groups", "2",
                   "--ffn-hidden-size", "64", *FP8["llama"], "--train-iters", "3"]
    reference = worlds.run(1, train_losses, base, timeout_s=LONG_RUN_S)[0]
    ranks = worlds.run(2, train_losses, base + ["--expert-model-parallel-size", "2"], timeout_s=LONG_RUN_S)
    assert ranks[0] == ranks[1]
    assert_losses_close(ranks[0], reference, "mixtral ep2 fp8", 1e-6)


def test_checkpoints_move_between_fp8_and_bf16_runs(worlds, tmp_path):
    """CPU (a gloo world of one). An FP8 run's checkpoint continues in bf16, whose checkpoint
    continues in FP8; each continuation stays within 2% of the uninterrupted bf16 run."""
    argv = TINY + FAMILIES["llama"] + ["--bf16", "--global-batch-size", "2"]
    fp8 = FP8["gpt"]
    straight, first, second, third = worlds.run(1, train_each, [
        argv + ["--train-iters", "6"],
        argv + fp8 + ["--train-iters", "2", "--save", str(tmp_path / "a")],
        argv + ["--train-iters", "4", "--load", str(tmp_path / "a"), "--save", str(tmp_path / "b")],
        argv + fp8 + ["--train-iters", "6", "--load", str(tmp_path / "b")]], timeout_s=LONG_RUN_S)[0]
    assert len(second) == len(third) == 2
    for got, want in zip(first + second + third, straight, strict=True):
        assert abs(got - want) < 0.02 * want


def test_the_pass_keeps_the_output_layer_and_outer_layers_and_refuses_by_name():
    """CPU (no tensor is run). What apply_fp8 converts, and the flags' refusals."""
    from mega_torchao.fp8 import apply_fp8, float8_config

    from mega.core.build import build_stage
    from mega.core.config import ConfigError
    from mega.train.command import parse_run
    from mega.train.run_config import derive

    run, family = parse_run(TINY + FAMILIES["llama"] + ["--num-layers", "4", "--untie-embeddings-and-output-weights"])
    stage = build_stage(family, run.model, device="cpu")
    report = apply_fp8(stage, float8_config("hybrid", "tensorwise"), num_layers=4, layers_at_start=1, layers_at_end=1)
    assert sorted(report.kept) == ["decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.mlp.linear_fc2",
                                   "decoder.layers.0.self_attention.linear_proj",
                                   "decoder.layers.0.self_attention.linear_qkv",
                                   "decoder.layers.3.mlp.linear_fc1", "decoder.layers.3.mlp.linear_fc2",
                                   "decoder.layers.3.self_attention.linear_proj",
                                   "decoder.layers.3.self_attention.linear_qkv", "output_layer"]
    assert len(report.fp8) == 8 and all(".layers.1." in n or ".layers.2." in n for n in report.fp8)
    assert type(stage.get_submodule("decoder.layers.1.mlp.linear_fc1")).__name__ == "Float8Linear"
    # Under a zero-bubble schedule mega's own FP8 linear, whose weight gradient waits for W.
    stage = build_stage(family, run.model, device="cpu")
    apply_fp8(stage, float8_config("hybrid", "tensorwise"), num_layers=4, defer_weight_grads=True)
    assert type(stage.get_submodule("decoder.layers.1.mlp.linear_fc1")).__name__ == "Float8DeferringLinear"

    def check(flags):
        derive(parse_run(TINY + FAMILIES["gpt"] + flags)[0], world_size=1)

    check(["--fp8-format", "hybrid", "--fp8-recipe", "rowwise", "--first-last-layers-bf16"])
    with pytest.raises(ConfigError, match=r"--fp8-recipe mxfp8: no installed kernel backend trains in it \(torchao: "
                                          r"MX FP8.*FP8 recipes offered: torchao: rowwise, tensorwise"):
        check(["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"])
    with pytest.raises(ConfigError, match="--fp8-recipe blockwise: no installed kernel backend"):
        check(["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"])
    with pytest.raises(ConfigError, match="--first-last-layers-bf16 needs --fp8-format"):
        check(["--first-last-layers-bf16"])
