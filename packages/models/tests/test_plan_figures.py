"""`mega plan` reproduces the seeds' figures: the 175B memory table and seed 004's layouts.

The seeds: GPT-3 175B in fp16 with Adam needs ~2,800 GB before activations (350 GB weights,
350 GB gradients, 2,100 GB of fp32 master weights and moments). Seed 004's layout table for
80 GB GPUs: 7B tp1 pp1 dp8; 13B tp2 pp1 dp4; 70B tp4 pp4 dp4; 405B tp8 pp8 dp2 cp2.
"""

from __future__ import annotations

import json

import pytest

from mega.train.planning.plan_command import main as plan_main

GB = 1e9


def _plan(capsys, *argv: str):
    code = plan_main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_175b_in_fp16_with_adam_needs_2800_gb_before_activations(capsys):
    code, plan = _plan(capsys, "--model-preset", "175b", "--fp16")
    assert code == 0
    rank = plan["ranks"][0]
    assert rank["parameters"] == pytest.approx(175e9, rel=0.01)
    assert rank["weights"] / GB == pytest.approx(350, rel=0.01)
    assert rank["gradients"] / GB == pytest.approx(350, rel=0.01)
    assert rank["optimizer"] / GB == pytest.approx(2100, rel=0.01)
    assert (rank["weights"] + rank["gradients"] + rank["optimizer"]) / GB == pytest.approx(2800, rel=0.01)
    assert not plan["fits"]


# (preset, GPUs, tp, pp, cp, dp, global batch)
SEED_004 = [
    ("llama2-7b", 8, 1, 1, 1, 8, 256),
    ("llama2-13b", 8, 2, 1, 1, 4, 256),
    ("llama3-70b", 64, 4, 4, 1, 4, 1024),
    ("llama3-405b", 256, 8, 8, 2, 2, 1024),
]


@pytest.mark.parametrize(("preset", "gpus", "tp", "pp", "cp", "dp", "batch"), SEED_004)
def test_seed_004_layouts_are_among_those_search_finds(capsys, preset, gpus, tp, pp, cp, dp, batch):
    # Seed 004's layouts shard the optimizer state (ZeRO-1): the search is held to it.
    code, layouts = _plan(capsys, "--model-family", "llama", "--model-preset", preset, "--bf16",
                          "--gpus", str(gpus), "--global-batch-size", str(batch), "--search", "--top", "100000",
                          "--data-parallel-sharding-strategy", "optim")
    assert code == 0
    found = [entry["layout"] for entry in layouts]
    assert any((f["tp"], f["pp"], f["cp"], f["dp"]) == (tp, pp, cp, dp) for f in found), \
        f"{preset}: seed 004's tp{tp} pp{pp} cp{cp} dp{dp} is not among the {len(found)} layouts that fit"
    assert all(entry["peak_bytes"] <= 0.9 * 80 * 1024**3 for entry in layouts)


def test_a_layout_that_cannot_fit_is_said_so(capsys):
    # 13B on one 80 GB GPU: 26 GB of bf16 weights, 26 GB of gradients, 156 GB of optimizer state.
    code, plan = _plan(capsys, "--model-family", "llama", "--model-preset", "llama2-13b", "--bf16")
    assert code == 0 and not plan["fits"]
    assert plan["ranks"][0]["optimizer"] / GB == pytest.approx(13.0e9 * 12 / GB, rel=0.02)


def test_plan_names_a_bad_flag(capsys):
    assert plan_main(["--model-preset", "175b", "--tensor-model-parallel-size", "3", "--gpus", "8"]) == 2
    assert "world size 8 is not divisible by tp*cp*pp" in capsys.readouterr().err


def test_pipeline_stages_hold_the_micro_batches_1f1b_keeps_in_flight():
    from mega.core.plugins import get_plugins
    from mega.train.planning.memory_plan import Layout, plan_memory

    family = get_plugins().models.get("gpt")
    config = family.preset("1.3b")
    ranks = plan_memory(family, config, Layout(pp=4, dp=2), dtype_bytes=2, num_microbatches=8)
    assert [rank.in_flight for rank in ranks] == [4, 3, 2, 1]  # stage i keeps pp - i
    per_microbatch = family.memory_model(config, layers=6, pre_process=False, post_process=False,
                                         parallel=Layout(pp=4).parallel, micro_batch_size=1, dtype_bytes=2)
    assert ranks[1].activations == 3 * per_microbatch.activation_bytes
    interleaved = plan_memory(family, config, Layout(pp=4, vpp=2, dp=2), dtype_bytes=2, num_microbatches=8)
    assert interleaved[0].in_flight == 2 * 3 + 4 + 1  # Megatron's warm-up (pp-1)*2 + (vpp-1)*pp, plus one
    # ZB-H1: every stage keeps pp micro-batches from F to W, stage i pp - i of them whole and,
    # from B on, i of them as their W's operands only (the first stage's B takes its W: 1F1B's).
    zb_h1 = plan_memory(family, config, Layout(pp=4, dp=2, schedule="zb-h1"), dtype_bytes=2, num_microbatches=8)
    assert [rank.in_flight for rank in zb_h1] == [4, 4, 4, 4]
    assert zb_h1[0].activations == ranks[0].activations
    assert 0 < per_microbatch.weight_grad_bytes < per_microbatch.activation_bytes
    for stage in (1, 2):
        assert zb_h1[stage].activations == ((4 - stage) * per_microbatch.activation_bytes
                                            + stage * per_microbatch.weight_grad_bytes)


def test_plan_prints_a_table_per_stage(capsys):
    assert plan_main(["--model-preset", "1.3b", "--bf16", "--gpus", "8", "--pipeline-model-parallel-size", "2",
                      "--use-distributed-optimizer", "--micro-batch-size", "4", "--global-batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "tp1 pp2 dp4 distopt mb4" in out and "weights GiB" in out and "fits in 80 GiB per GPU" in out
    assert out.count("\n    0 ") == 1 and out.count("\n    1 ") == 1  # one row per stage


def test_plan_takes_uneven_layouts_and_zero_bubble_schedules(capsys):
    # GPT 1.3B (24 layers; its output layer, 50k x 2048, costs about two layers), pp4.
    base = ["--model-preset", "1.3b", "--bf16", "--gpus", "4", "--pipeline-model-parallel-size", "4",
            "--global-batch-size", "16"]
    code, even = _plan(capsys, *base)
    assert code == 0 and [rank["layers"] for rank in even["ranks"]] == [6, 6, 6, 6]
    code, layout = _plan(capsys, *base, "--pipeline-model-parallel-layout", "Et*7|t*7|t*7|t*3,L")
    assert code == 0 and [rank["layers"] for rank in layout["ranks"]] == [7, 7, 7, 3]
    assert layout["step_time_s"] < even["step_time_s"]  # the last rank no longer also carries the loss
    code, zb = _plan(capsys, *base, "--pipeline-schedule", "zb-h1")
    assert code == 0 and zb["bubble"] == pytest.approx(3 / (3 * 16 + 3)) and even["bubble"] == pytest.approx(3 / 19)
    assert [rank["in_flight"] for rank in zb["ranks"]] == [4, 4, 4, 4]  # from F to W
    assert plan_main([*base, "--pipeline-model-parallel-layout", "Et*7|t*7|t*7|t*2,L"]) == 2
    assert "places 23 transformer layers, but the model has 24" in capsys.readouterr().err


def test_search_proposes_uneven_layouts(capsys):
    code, layouts = _plan(capsys, "--model-family", "llama", "--model-preset", "llama2-7b", "--bf16", "--gpus", "4",
                          "--global-batch-size", "16", "--search", "--top", "100000")
    assert code == 0
    uneven = [entry["layout"]["layers_per_stage"] for entry in layouts if entry["layout"]["layers_per_stage"]]
    assert [7, 9, 9, 7] in uneven  # Megatron's embedding + loss accounting at pp4


def test_search_shards_with_fsdp_only_where_the_distributed_optimizer_does_not_fit():
    """LLaMA 3 8B on 8 GPUs of 40 GB: some layouts fit only under FSDP; each layout comes with the
    least sharding that fits (ZeRO-1, then ZeRO-2, then ZeRO-3), as `mega plan --search` says."""
    import dataclasses

    from mega.core.plugins import get_plugins
    from mega.train.planning.step_estimate import (
        MEMORY_HEADROOM,
        SHARDING_ORDER,
        estimate,
        search,
        with_recompute,
    )

    family = get_plugins().models.get("llama")
    config = family.preset("llama3-8b")
    budget = 40 * 1024**3
    common = dict(global_batch_size=64, dtype_bytes=2, grad_dtype_bytes=4)
    results = search(family, config, world_size=8, gpu_memory_bytes=budget, micro_batch_sizes=(1,), **common)
    fsdp = [r for r in results if r.layout.fully_sharded]
    assert fsdp, "no layout needs FSDP"
    for result in fsdp:
        model = with_recompute(config, result.layout.recompute)
        for less in SHARDING_ORDER[1:SHARDING_ORDER.index(result.layout.sharding)]:
            layout = dataclasses.replace(result.layout, sharding=less)
            assert estimate(family, model, layout, **common).peak_bytes > budget * (1 - MEMORY_HEADROOM), \
                f"{layout.describe()} fits: the search should have kept it"


def test_expert_parallelism_splits_the_experts_and_their_optimizer_state(capsys):
    """CPU, arithmetic only. Mixtral 8x7B on 16 GPUs at pp2 with the distributed optimizer: at ep8
    a rank holds one expert of eight per layer; its optimizer state is the dense part over dp8 and
    the experts over their own data-parallel group (dp8 x tp1 / ep8 = 1), the same bytes as ep1's
    8-way shard of everything. A DeepSeek preset (its per-layer MoE pattern) plans at pp2."""
    base = ["--model-family", "mixtral", "--model-preset", "8x7b", "--bf16", "--gpus", "16",
            "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]
    _, ep1 = _plan(capsys, *base)
    _, ep8 = _plan(capsys, *base, "--expert-model-parallel-size", "8")
    assert ep8["layout"]["ep"] == 8
    for one, eight in zip(ep1["ranks"], ep8["ranks"], strict=True):
        experts = 16 * 8 * 3 * 4096 * 14336  # a stage's 16 layers of 8 experts (gated, 4096 -> 14336)
        assert one["parameters"] - eight["parameters"] == experts * 7 // 8
        assert abs(one["optimizer"] - eight["optimizer"]) <= 16 * 8  # padding-free: the same elements
    assert plan_main(["--model-family", "deepseek-v3", "--model-preset", "v2-lite", "--bf16", "--gpus", "16",
                      "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "8"]) == 0
    assert "tp1 pp2 dp8 ep8" in capsys.readouterr().out
