"""Gradient-accumulation fusion (--gradient-accumulation-fusion) on the CPU: the weight-gradient
GEMM accumulating into main_grad (accumulate_weight_grad, the function the GPU path calls too)
gives the main grads of the unfused path (a bf16/fp32 gradient added by the data-parallel hook)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mega.core.distributed.ddp import DDPConfig, DistributedDataParallel
from mega.core.parallel import ParallelConfig, ParallelGroups
from mega.core.parallel import grad_accumulation_fusion as fusion
from mega.core.parallel.groups import Group
from mega.core.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mega.core.parallel.param_attrs import mark_padded_vocab


class Tiny(nn.Module):
    """The three linear layers that go through the fused function, and a tied vocabulary weight
    used by a lookup and by a linear layer (never fused: its lookup's gradient is ordinary)."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        one = Group("tp", (0,), 0, None)
        self.embedding = nn.Embedding(24, 16, dtype=dtype)
        self.fc = fusion.Linear(16, 32, dtype=dtype)
        self.column = ColumnParallelLinear.from_linear(nn.Linear(32, 32, dtype=dtype), one)
        self.row = RowParallelLinear.from_linear(nn.Linear(32, 16, dtype=dtype), one)
        self.head = fusion.Linear(16, 24, bias=False, dtype=dtype)
        self.head.weight = self.embedding.weight
        mark_padded_vocab(self.head.weight)

    def forward(self, ids):
        hidden = self.embedding(ids)
        return self.head(self.row(torch.nn.functional.gelu(self.column(self.fc(hidden)))))


def _main_grads(dtype, fused: bool, calls: list):
    model = Tiny(dtype)
    ddp = DistributedDataParallel(model, ParallelGroups(ParallelConfig()),
                                  DDPConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True,
                                            gradient_accumulation_fusion=fused))
    ddp.zero_grad_buffer()
    for step in range(3):  # three micro-batches, the last one reducing
        ids = torch.randint(0, 24, (4, 5), generator=torch.Generator().manual_seed(step))
        with ddp.no_sync() if step < 2 else torch.enable_grad():
            ddp(ids).float().square().mean().backward()
    ddp.finish_grad_sync()
    return {name: p.main_grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_main_grads_equal_the_unfused_ones(monkeypatch, dtype):
    calls = []
    accumulate = fusion.accumulate_weight_grad
    monkeypatch.setattr(fusion, "accumulate_weight_grad",
                        lambda main_grad, *args: calls.append(main_grad.shape) or accumulate(main_grad, *args))
    unfused = _main_grads(dtype, False, calls)
    assert calls == []
    fused = _main_grads(dtype, True, calls)
    if dtype == torch.float32:  # fp32 buffer, fp32 weights: fused here (addmm_), as with fp32 anywhere
        assert sorted(calls) == sorted([torch.Size([32, 16]), torch.Size([32, 32]), torch.Size([16, 32])] * 3)
    else:  # bf16 weights into an fp32 buffer: the GEMM with an fp32 output is CUDA's; the CPU runs unfused
        assert calls == [] and not fusion.can_fuse(torch.zeros(1), torch.zeros(1, dtype=dtype))
    for name, grad in unfused.items():
        # One GEMM adding into main_grad rounds once where the unfused path rounds twice.
        torch.testing.assert_close(fused[name], grad, rtol=1e-6, atol=1e-7, msg=name)
        assert grad.abs().sum() > 0, name
