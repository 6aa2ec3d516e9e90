"""fp16/bf16 parameters with fp32 main weights, loss scaling, and clipping by the global norm."""

from __future__ import annotations

import math

import pytest
import torch

from mega.core.distributed import DDPConfig
from mega.core.optim import DynamicGradScaler, OptimizerConfig
from mega.core.parallel import ParallelConfig
from mega.testing.equivalence import assert_matches, reference_train, train_tiny_lm
from mega.testing.tiny_lm import TinyConfig, TinyLM

TP2_DP2_SP = ParallelConfig(tp=2, sequence_parallel=True)


# ------------------------------------------------------------------ the loss scaler's rules


def test_dynamic_scaler_defaults_hysteresis_backoff_and_growth():
    scaler = DynamicGradScaler()
    assert scaler.scale == 2.0**32
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0**32  # hysteresis 2: the first overflow is forgiven
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0**31
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0**30  # hysteresis stays used up until the scale grows again
    for _ in range(999):
        scaler.update(found_inf=False)
    assert scaler.scale == 2.0**30
    scaler.update(found_inf=False)
    assert scaler.scale == 2.0**31  # growth after 1000 clean steps restores the hysteresis
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0**31
    restored = DynamicGradScaler()
    restored.load_state_dict(scaler.state_dict())
    restored.update(found_inf=True)
    assert restored.scale == 2.0**30


def test_dynamic_scaler_never_goes_below_its_minimum_and_rejects_bad_settings():
    scaler = DynamicGradScaler(initial_scale=4.0, min_scale=1.0, hysteresis=1)
    for _ in range(5):
        scaler.update(found_inf=True)
    assert scaler.scale == 1.0
    with pytest.raises(ValueError, match="backoff_factor=1.5"):
        DynamicGradScaler(backoff_factor=1.5)


# ------------------------------------------------------------------ fp16 / bf16 training


def fp16_runs():
    fp16 = OptimizerConfig(lr=1e-3)
    ddp = DDPConfig(bucket_size=3000, overlap_grad_reduce=True)
    poisoned = train_tiny_lm(TP2_DP2_SP, steps=4, ddp=ddp, optimizer=fp16, dtype=torch.float16, poison_step=1,
                             grad_scaler=DynamicGradScaler(2.0**12))
    without_that_step = train_tiny_lm(TP2_DP2_SP, steps=4, ddp=ddp, optimizer=fp16, dtype=torch.float16,
                                      skip_steps=(1,), grad_scaler=DynamicGradScaler(2.0**12))
    # Megatron's default initial scale 2**32 overflows fp16 gradients: those steps are skipped.
    overflowing = train_tiny_lm(TP2_DP2_SP, steps=3, ddp=ddp, optimizer=fp16, dtype=torch.float16,
                                grad_scaler=DynamicGradScaler())
    untouched = train_tiny_lm(TP2_DP2_SP, steps=0, ddp=ddp, dtype=torch.float16)
    return poisoned, without_that_step, overflowing, untouched


def test_fp16_skips_a_poisoned_step_on_every_rank(worlds):
    for poisoned, without_that_step, overflowing, untouched in worlds.run(4, fp16_runs):
        # Only rank 0's gradients were NaN; every rank skipped the step and nothing changed.
        assert poisoned.applied == [True, False, True, True]
        assert math.isnan(poisoned.grad_norms[1])
        assert poisoned.loss_scales == [2.0**12] * 4  # hysteresis 2: one overflow does not back off
        for name, param in poisoned.params.items():
            assert torch.equal(param, without_that_step.params[name]), name

        assert overflowing.applied == [False, False, False]
        assert overflowing.loss_scales == [2.0**32, 2.0**32, 2.0**31]
        for name, param in overflowing.params.items():
            assert torch.equal(param, untouched.params[name]), name


def low_precision_run(dtype):
    config = OptimizerConfig(lr=1e-3, clip_grad=1.0)
    return train_tiny_lm(ParallelConfig(), steps=3, ddp=DDPConfig(bucket_size=3000), optimizer=config, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_train_like_fp32_with_fp32_main_weights(worlds, dtype):
    reference = reference_train(steps=3, optimizer=OptimizerConfig(lr=1e-3, clip_grad=1.0))
    params = sum(p.numel() for p in TinyLM(TinyConfig()).parameters())
    for result in worlds.run(4, low_precision_run, dtype):
        assert all(result.applied)
        for loss, ref in zip(result.losses, reference.losses, strict=True):
            assert abs(loss - ref) <= 2e-2 * ref
        # fp32 main copies (4 bytes) plus two fp32 Adam moments (8 bytes) per parameter.
        assert result.state_bytes == 12 * params


# ------------------------------------------------------------------ clipping over shards


def clipped_run():
    return train_tiny_lm(TP2_DP2_SP, steps=3, micro_batches=2, ddp=DDPConfig(bucket_size=3000),
                         optimizer=OptimizerConfig(lr=1e-3, clip_grad=0.05))


def test_clipping_uses_the_single_process_norm_over_tp_dp_and_sequence_shards(worlds):
    reference = reference_train(steps=3, optimizer=OptimizerConfig(lr=1e-3, clip_grad=0.05))
    assert all(norm > 0.05 for norm in reference.grad_norms)
    for result in worlds.run(4, clipped_run):
        assert_matches(result, reference)


def clip_grad_norm_check():
    from mega.core.optim import clip_grad_norm_
    from mega.core.parallel import ParallelGroups, apply_tensor_parallel
    from mega.testing.tiny_lm import PLAN, make_batch

    groups = ParallelGroups(TP2_DP2_SP)
    torch.manual_seed(0)
    model = apply_tensor_parallel(TinyLM(TinyConfig()), PLAN, groups)
    tokens, labels = make_batch(TinyConfig(), 4, 0)
    model(tokens, labels, groups.tp).backward()  # every dp rank runs the whole batch: replicas
    from mega.core.parallel.collectives import all_reduce
    from mega.core.parallel.param_attrs import is_sequence_parallel

    for param in model.parameters():
        if is_sequence_parallel(param):
            all_reduce(param.grad, groups.tp)
    return clip_grad_norm_(model.parameters(), 0.0, groups)


def test_clip_grad_norm_helper_counts_every_parameter_once(worlds):
    torch.manual_seed(0)
    model = TinyLM(TinyConfig())
    from mega.core.parallel import ParallelGroups
    from mega.testing.tiny_lm import make_batch

    tokens, labels = make_batch(TinyConfig(), 4, 0)
    model(tokens, labels, ParallelGroups(ParallelConfig()).tp).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    for norm in worlds.run(4, clip_grad_norm_check):
        assert abs(norm - expected) <= 1e-5 * expected
