"""Megatron's ``adam`` takes torch's fused AdamW on CUDA and foreach elsewhere; both update alike."""

from __future__ import annotations

import torch

from mega.core.optim.config import OptimizerConfig
from mega.core.optim.torch_optimizers import adam, adamw_kernel


def test_fused_on_cuda_foreach_elsewhere():
    assert adamw_kernel({"cuda"}) == {"fused": True}
    assert adamw_kernel({"cpu"}) == {"foreach": True}
    assert adamw_kernel({"cuda", "cpu"}) == {"foreach": True}  # fused needs every tensor on one kind


def test_the_fused_kernel_updates_as_foreach_does():
    # torch's fused AdamW also runs on the CPU: the same options mega passes on CUDA, checked here.
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(8, 4, generator=gen), torch.randn(4, generator=gen)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(3)]
    results = []
    for options in ({"foreach": True}, {"fused": True}):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        groups = [{"params": params, "weight_decay": config.weight_decay}]
        optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                      eps=config.adam_eps, **options)
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            optimizer.step()
        results.append([p.detach() for p in params])
    for foreach, fused in zip(*results, strict=True):
        torch.testing.assert_close(fused, foreach, rtol=1e-6, atol=1e-7)
    on_cpu = adam([{"params": [torch.nn.Parameter(torch.zeros(2))]}], config)
    assert on_cpu.defaults["foreach"] is True and not on_cpu.defaults["fused"]
