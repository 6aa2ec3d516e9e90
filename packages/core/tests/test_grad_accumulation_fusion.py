"""Gradient-accumulation fusion (--gradient-accumulation-fusion): the weight-gradient GEMM
accumulating into main_grad (accumulate_weight_grad, the one function every device calls) gives
the main grads of the unfused path (a gradient the data-parallel hook adds). CPU: fp32 weights
fused, bf16 weights unfused (torch's fp32-output GEMM is CUDA's); on a GPU also bf16 fused."""

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


def _main_grads(dtype, fused: bool, device: str):
    model = Tiny(dtype).to(device)
    ddp = DistributedDataParallel(model, ParallelGroups(ParallelConfig()),
                                  DDPConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True,
                                            gradient_accumulation_fusion=fused))
    ddp.zero_grad_buffer()
    for step in range(3):  # three micro-batches, the last one reducing
        ids = torch.randint(0, 24, (4, 5), generator=torch.Generator().manual_seed(step)).to(device)
        with ddp.no_sync() if step < 2 else torch.enable_grad():
            ddp(ids).float().square().mean().backward()
    ddp.finish_grad_sync()
    return {name: p.main_grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(("device", "dtype"), [("cpu", torch.float32), ("cpu", torch.bfloat16),
                                             ("cuda", torch.bfloat16)])
def test_fused_main_grads_equal_the_unfused_ones(monkeypatch, device, dtype):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here: the fp32-output GEMM from bf16 operands (addmm out_dtype) is CUDA's")
    calls = []
    accumulate = fusion.accumulate_weight_grad
    monkeypatch.setattr(fusion, "accumulate_weight_grad",
                        lambda main_grad, *args: calls.append(main_grad.shape) or accumulate(main_grad, *args))
    unfused = _main_grads(dtype, False, device)
    assert calls == []
    fused = _main_grads(dtype, True, device)
    # One GEMM adding into main_grad rounds once where the unfused path rounds twice: fp32 rounding
    # for fp32 weights; bf16 weights' unfused gradient is rounded to bf16 before the fp32 add.
    tolerance = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-4)
    if fusion.can_fuse(torch.zeros(1, device=device), torch.zeros(1, dtype=dtype, device=device)):
        assert sorted(calls) == sorted([torch.Size([32, 16]), torch.Size([32, 32]), torch.Size([16, 32])] * 3)
    else:  # bf16 weights into an fp32 buffer on the CPU: unfused
        assert calls == [] and device == "cpu"
    for name, grad in unfused.items():
        torch.testing.assert_close(fused[name], grad, **tolerance, msg=name)
        assert grad.abs().sum() > 0, name
