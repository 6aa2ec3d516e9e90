"""MoE routing against megatron-core's own functions (its ``moe_utils`` run on the CPU): top-k
weights with and without pre-softmax, capacity dropping (drop policy "probs"), the Switch
load-balancing loss, the per-sequence variant and the z-loss. Then the family's description:
presets' parameter counts (total and active) and FLOPs, and the errors for bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mega.models.mixtral.family import PRESETS
from mega.models.moe.routing import route

moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

SEQ, BATCH, EXPERTS, TOPK = 16, 4, 8, 2


def as_dense(routing, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k] experts and weights -> megatron's [T, E] probabilities and map."""
    probs = torch.zeros(tokens, EXPERTS).scatter(1, routing.experts, routing.weights)
    chosen = torch.zeros(tokens, EXPERTS, dtype=torch.bool).scatter(1, routing.experts, routing.kept)
    return probs, chosen


@pytest.mark.parametrize("pre_softmax", [False, True])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_routing_matches_megatron_core(pre_softmax, capacity_factor):
    config = dataclasses.replace(PRESETS["tiny"], num_experts=EXPERTS, moe_router_topk=TOPK,
                                 moe_router_pre_softmax=pre_softmax, moe_expert_capacity_factor=capacity_factor,
                                 moe_z_loss_coeff=1.0)
    logits = torch.randn(SEQ * BATCH, EXPERTS, generator=torch.Generator().manual_seed(3)) * 2
    routing = route(logits, config, sequences=BATCH)
    probs, chosen = as_dense(routing, logits.shape[0])

    expected_probs, expected_map = moe_utils.topk_routing_with_score_function(logits, TOPK, use_pre_softmax=pre_softmax)
    load = expected_map.sum(0)
    if capacity_factor is not None:
        expected_probs, expected_map = moe_utils.apply_router_token_dropping(
            expected_probs, expected_map, TOPK, capacity_factor)
        assert (expected_map.sum() < SEQ * BATCH * TOPK), "the test should drop slots"
    assert torch.equal(chosen, expected_map)
    torch.testing.assert_close(probs, expected_probs, rtol=1e-6, atol=1e-7)

    scores = torch.softmax(logits, dim=-1)
    expected_aux = moe_utils.switch_load_balancing_loss_func(scores, load, SEQ * BATCH, TOPK, EXPERTS, 1.0)
    torch.testing.assert_close(routing.aux_loss, expected_aux, rtol=1e-6, atol=0)
    torch.testing.assert_close(routing.z_loss, moe_utils.z_loss_func(logits, 1.0), rtol=1e-6, atol=0)


def test_sequence_aux_loss_matches_megatron_core():
    config = dataclasses.replace(PRESETS["tiny"], num_experts=EXPERTS, moe_router_topk=TOPK,
                                 moe_router_load_balancing_type="seq_aux_loss")
    logits = torch.randn(SEQ * BATCH, EXPERTS, generator=torch.Generator().manual_seed(4))
    routing = route(logits, config, sequences=BATCH)
    # Megatron's _apply_seq_aux_loss: [s, b * E] scores and map, topk * b per "token", / b.
    _, routing_map = moe_utils.topk_routing_with_score_function(logits, TOPK)
    scores = torch.softmax(logits, dim=-1).reshape(SEQ, -1)
    routing_map = routing_map.reshape(SEQ, -1)
    expected = moe_utils.switch_load_balancing_loss_func(scores, routing_map.sum(0), SEQ, TOPK, EXPERTS, 1.0) / BATCH
    torch.testing.assert_close(routing.aux_loss, expected, rtol=1e-6, atol=0)


def test_presets_size_and_flops():
    from mega.models.mixtral.model import num_moe_floating_point_operations, num_moe_parameters

    config = PRESETS["8x7b"]
    # Mixtral-8x7B: 46.7B parameters, 12.9B active per token (Mistral AI's figures).
    assert round(num_moe_parameters(config) / 1e9, 1) == 46.7
    assert round(num_moe_parameters(config, active=True) / 1e9, 1) == 12.9
    assert round(num_moe_parameters(PRESETS["8x22b"]) / 1e9) == 141
    # FLOPs count the top-k experts a token passes through (and the router), not all experts:
    # 6 x active parameters per token (less the embedding table) plus attention.
    h, s = config.hidden_size, config.seq_length
    dense = dataclasses.replace(config, ffn_hidden_size=2 * config.moe_ffn_hidden_size)
    from mega.models.flops import num_floating_point_operations

    router = 6 * s * config.num_layers * h * config.num_experts
    assert num_moe_floating_point_operations(config, 1) == pytest.approx(
        num_floating_point_operations(dense, 1) + router)


def test_bad_input_names_the_flags():
    from mega.core.config import ConfigError
    from mega.models.config import ModelConfigError
    from mega.train.command import parse_run
    from mega.train.run_config import derive

    base = ["--model-family", "mixtral", "--model-preset", "tiny", "--mock-data"]
    run, _ = parse_run(base + ["--num-experts", "6", "--expert-model-parallel-size", "4"])
    with pytest.raises(ModelConfigError, match="--num-experts 6 is not divisible by --expert-model-parallel-size 4"):
        derive(run, 4)
    run, _ = parse_run(base + ["--expert-tensor-parallel-size", "1", "--tensor-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size 1 differs from --tensor-model-parallel-size "
                       "2: this needs --sequence-parallel"):
        derive(run, 2)
    run, _ = parse_run(base + ["--expert-tensor-parallel-size", "3", "--tensor-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size 3 must be a positive divisor of "
                       "--tensor-model-parallel-size 2"):
        derive(run, 2)
    run, _ = parse_run(base + ["--expert-tensor-parallel-size", "1", "--tensor-model-parallel-size", "2",
                               "--sequence-parallel", "--expert-model-parallel-size", "4"])
    with pytest.raises(ConfigError, match=r"ep = 4 must divide dp\*cp\*tp/etp = 1\*1\*2/1 = 2"):
        derive(run, 2)
    run, _ = parse_run(base + ["--moe-ffn-hidden-size", "31", "--tensor-model-parallel-size", "2"])
    with pytest.raises(ModelConfigError, match="--moe-ffn-hidden-size 31 is not divisible by "
                       "--tensor-model-parallel-size 2"):
        derive(run, 4)
    with pytest.raises(ConfigError, match="--moe-router-topk 5 must be between 1 and --num-experts 4"):
        parse_run(base + ["--moe-router-topk", "5"])
    run, _ = parse_run(base + ["--expert-model-parallel-size", "4", "--tensor-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match="--expert-model-parallel-size: ep = 4 must divide"):
        derive(run, 4)
    with pytest.raises(ConfigError, match="--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"):
        parse_run(base + ["--moe-pad-expert-input-to-capacity"])
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size needs an MoE model family; 'gpt' is not one"):
        derive(parse_run(["--model-family", "gpt", "--expert-tensor-parallel-size", "1", "--mock-data"])[0], 1)
    with pytest.raises(ConfigError, match="--num-experts .*needs an MoE model family; 'gpt' is not one"):
        derive(parse_run(["--model-family", "gpt", "--num-experts", "4", "--mock-data"])[0], 1)
