"""LoRA adapters (mega.models.lora.adapters): a fresh adapter leaves the logits unchanged, merged adapters
give the unmerged logits, only adapters train, bad targets name the flag, and at tp2 (with and
without sequence parallelism) the loss and every adapter gradient equal one process's (fp32); the
same world checks packed rows at tp2 with sequence parallelism and at cp2 (test_packed_sequences.py)."""

from __future__ import annotations

import os
import sys
import zlib

import pytest
import torch

from mega.core.parallel import ParallelConfig

sys.path.insert(0, os.path.dirname(__file__))  # ranks load this file by path
from test_packed_sequences import check_context_parallel_token_losses, context_parallel_token_losses  # noqa: E402
from test_packed_sequences import loss_and_grads as packed_loss_and_grads  # noqa: E402
from whole_gradients import whole_gradients  # noqa: E402

SEQ, SEED = 16, 11
FAMILIES = ("gpt", "llama")


def tiny(family_name, groups=None, parallel=ParallelConfig()):
    from mega.core.build import build_stage
    from mega.core.plugins import get_plugins

    family = get_plugins().models.get(family_name)
    config = family.preset("tiny", vocab_size=256, seq_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                           num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)
    return build_stage(family, config, groups=groups, parallel=parallel, seed=SEED)


def settings(targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")):
    from mega.models.lora.adapters import LoRASettings

    return LoRASettings(rank=4, alpha=8.0, targets=targets)


def tokens():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (2, SEQ), generator=generator), torch.randint(0, 256, (2, SEQ), generator=generator)


@torch.no_grad()
def randomize_adapters(model, tp=None):
    """Give every A and B values from its global name, so the adapters change the function."""
    from mega.core.parallel.layers import shard_of
    from mega.core.parallel.param_attrs import is_tensor_parallel
    from mega.models.lora.adapters import adapter_parameters

    for name, param in adapter_parameters(model).items():
        split = tp is not None and is_tensor_parallel(param)
        shape = list(param.shape)
        if split:
            shape[param.partition_dim] *= tp.size
        full = torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.2
        param.copy_(shard_of(full, tp, param.partition_dim, param.partition_chunks) if split else full)


def test_fresh_adapters_change_nothing_and_merge_exactly():
    from mega.models.lora.adapters import apply_lora, merge_lora

    ids, _ = tokens()
    for family_name in FAMILIES:
        model = tiny(family_name)
        with torch.no_grad():
            base = model(ids)
            adapted = apply_lora(model, settings(), SEED)
            assert len(adapted) == 8 and torch.equal(model(ids), base), family_name  # B = 0
            randomize_adapters(model)
            unmerged = model(ids)
            assert not torch.allclose(unmerged, base, atol=1e-3)
            assert merge_lora(model) == 8
            torch.testing.assert_close(model(ids), unmerged, rtol=1e-5, atol=1e-5)
        assert not any(".adapter." in name for name, _ in model.named_parameters())


def test_only_adapters_train():
    from mega.models.lora.adapters import apply_lora

    model = tiny("llama")
    apply_lora(model, settings(("linear_qkv", "linear_fc2")), SEED)
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    assert trainable and all(".adapter." in name for name in trainable)
    assert {name.split(".")[-4] for name in trainable} == {"linear_qkv", "linear_fc2"}
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    ids, labels = tokens()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.loss(model(ids), labels).mean().backward()
    optimizer.step()
    changed = {name for name, param in model.named_parameters() if not torch.equal(param, before[name])}
    assert changed and all(".adapter." in name for name in changed)


def test_bad_targets_name_the_flag():
    from mega.models.lora.adapters import LoRAError, apply_lora, lora_targets

    with pytest.raises(LoRAError, match="--lora-target-modules linear_q: not a LoRA target"):
        lora_targets(["linear_qkv", "linear_q"])
    assert lora_targets(None) == lora_targets(["all-linear"]) == settings().targets
    from mega.core.build import build_stage
    from mega.core.plugins import get_plugins

    mixtral = get_plugins().models.get("mixtral")
    model = build_stage(mixtral, mixtral.preset("tiny", vocab_size=256), seed=SEED)
    with pytest.raises(LoRAError, match="--lora-target-modules linear_fc1: .*experts.linear_fc1 is a"):
        apply_lora(model, settings(), SEED)


def loss_and_adapter_grads(family_name, groups=None, parallel=ParallelConfig()):
    from mega.models.lora.adapters import adapter_parameters, apply_lora

    model = tiny(family_name, groups, parallel)
    apply_lora(model, settings(), SEED)
    tp = groups.tp if groups is not None else None
    randomize_adapters(model, tp)
    ids, labels = tokens()
    loss = model.loss(model(ids), labels, tp).mean()
    loss.backward()
    return loss.detach(), whole_gradients(adapter_parameters(model).items(), tp)


def tensor_parallel_lora():
    from mega.core.parallel import ParallelGroups

    results = {}
    for sequence_parallel in (False, True):
        parallel = ParallelConfig(tp=2, sequence_parallel=sequence_parallel)
        groups = ParallelGroups(parallel)
        for family_name in FAMILIES:
            results[family_name, sequence_parallel] = loss_and_adapter_grads(family_name, groups, parallel)
            if sequence_parallel:  # packed rows (test_packed_sequences.py), in this world
                results[family_name, "packed"] = packed_loss_and_grads(family_name, groups, parallel)
    for family_name in FAMILIES:  # and packed rows at cp2
        results[family_name, "packed cp2"] = context_parallel_token_losses(family_name)
    return results


def test_lora_and_packed_rows_tp2_equal_one_process(worlds, assert_close):
    ranks = worlds.run(2, tensor_parallel_lora)
    for family_name in FAMILIES:
        ref_loss, ref_grads = loss_and_adapter_grads(family_name)
        assert len(ref_grads) == 16
        packed_loss, packed_grads = packed_loss_and_grads(family_name)
        check_context_parallel_token_losses(family_name, ranks)
        for rank, results in enumerate(ranks):
            loss, grads = results[family_name, "packed"]
            assert_close(loss, packed_loss, what=f"{family_name} packed rank {rank} loss")
            for name, grad in packed_grads.items():
                assert_close(grads[name], grad, what=f"{family_name} packed rank {rank} grad {name}")
        for (name, sequence_parallel), result in ranks[0].items():
            if name != family_name or sequence_parallel in ("packed", "packed cp2"):
                continue
            loss, grads = result
            where = f"{family_name} sp={sequence_parallel}"
            assert_close(loss, ref_loss, what=f"{where} loss")
            for grad_name, grad in ref_grads.items():
                assert_close(grads[grad_name], grad, what=f"{where} grad {grad_name}")
