"""``--optimizer muon`` against torch.optim.Muon / torch.optim.AdamW on one process, and its
tensor-parallel, ZeRO-1 and FSDP2 layouts against one process (CPU, fp32, gloo; pinned to CPU so
it runs alike on a GPU machine)."""

from __future__ import annotations

import pytest
import torch
from mega_muon.layout import RowBlocks, takes_muon
from mega_muon.muon import coefficient_schedule, newton_schulz

from mega.core.distributed import DDPConfig
from mega.core.optim import OptimizerConfig
from mega.core.parallel import ParallelConfig, ParallelGroups
from mega.testing.equivalence import max_relative_error, train_tiny_lm
from mega.testing.tiny_lm import TinyConfig, TinyLM, make_batch

STEPS = 10
CONFIG = TinyConfig()
# Clipping off: the comparison is of the optimizers; a whole-model norm is tested elsewhere.
BASE = {"optimizer": "muon", "lr": 2e-3, "weight_decay": 0.1, "clip_grad": 0.0, "muon_momentum": 0.95,
        "muon_use_nesterov": True, "muon_coefficient_type": "simple", "muon_split_qkv": False,
        "muon_split_gate_up": False}
# torch.optim.Muon's two learning-rate adjustments, in Megatron's terms.
SCALES = {
    "original": {"muon_scale_mode": "shape_scaling"},
    "match_rms_adamw": {"muon_scale_mode": "spectral", "muon_extra_scale_factor": 0.2},
}


def torch_reference(config: OptimizerConfig, adjust_lr_fn: str) -> dict[str, torch.Tensor]:
    """The tiny LLaMA-style model trained with torch.optim.Muon on the hidden matrices and
    torch.optim.AdamW on the rest (Megatron's split), as train_tiny_lm trains it."""
    tp = ParallelGroups(ParallelConfig()).tp
    torch.manual_seed(0)
    model = TinyLM(CONFIG)
    named = list(model.named_parameters())
    matrices = [p for n, p in named if takes_muon(n, p)]
    decay = [p for n, p in named if not takes_muon(n, p) and p.dim() > 1]
    no_decay = [p for n, p in named if not takes_muon(n, p) and p.dim() == 1]
    assert len(matrices) == 4 * CONFIG.layers and len(decay) == 2, "qkv, proj, fc1, fc2; embedding, output"
    muon = torch.optim.Muon(matrices, lr=config.lr, weight_decay=config.weight_decay, momentum=config.muon_momentum,
                            nesterov=True, adjust_lr_fn=adjust_lr_fn)
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=config.lr,
                              betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
    for step in range(STEPS):
        tokens, labels = make_batch(CONFIG, 4, step)
        muon.zero_grad()
        adamw.zero_grad()
        model(tokens, labels, tp).backward()
        muon.step()
        adamw.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("adjust_lr_fn", list(SCALES))
def test_muon_equals_torch_muon_and_adamw(adjust_lr_fn):
    config = OptimizerConfig(**BASE, muon_fp32_matmul_prec="medium", **SCALES[adjust_lr_fn])
    result = train_tiny_lm(steps=STEPS, optimizer=config)
    reference = torch_reference(config, adjust_lr_fn)
    for name, expected in reference.items():
        assert max_relative_error(result.params[name], expected) < 1e-6, name


def test_split_orthogonalises_each_logical_matrix():
    """Fused QKV (per query group) and [gate; up] are orthogonalised block by block."""
    torch.manual_seed(0)
    schedule = coefficient_schedule("quintic", 5)
    blocks = RowBlocks((4, 2, 2))  # 2 queries per group, head_dim 2
    fused = torch.randn(3 * 8, 16)  # 3 query groups
    q, k, v = (fused.view(3, 8, 16)[:, lo:hi].reshape(-1, 16) for lo, hi in ((0, 4), (4, 6), (6, 8)))
    merged = blocks.merge([newton_schulz(m, schedule, "highest") for m in blocks.split(fused)])
    for part, (lo, hi) in zip((q, k, v), ((0, 4), (4, 6), (6, 8)), strict=True):
        got = merged.view(3, 8, 16)[:, lo:hi].reshape(-1, 16)
        torch.testing.assert_close(got, newton_schulz(part, schedule, "highest"), rtol=0, atol=0)
    # An orthogonalised wide matrix has (nearly) orthonormal rows.
    rows = newton_schulz(torch.randn(8, 32), coefficient_schedule("polar_express", 8), "highest")
    torch.testing.assert_close(rows @ rows.T, torch.eye(8), atol=0.1, rtol=0)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="multiple of 5"):
        train_tiny_lm(steps=1, optimizer=OptimizerConfig(optimizer="muon", muon_num_ns_steps=4))
    with pytest.raises(ValueError, match="muon-momentum"):
        OptimizerConfig(optimizer="muon", muon_momentum=1.0)


# fp32 Newton-Schulz: the layouts' gradients differ from one process's in the last bits, which
# bf16 iterations would magnify.
LAYOUT_MUON = OptimizerConfig(**{**BASE, "muon_split_qkv": True, "muon_split_gate_up": True,
                                 "muon_coefficient_type": "quintic", "muon_fp32_matmul_prec": "highest"})
LAYOUT_STEPS = 4


def _train(layout: ParallelConfig, distributed: bool) -> dict[str, torch.Tensor]:
    optimizer = OptimizerConfig(**{**vars(LAYOUT_MUON), "use_distributed_optimizer": distributed})
    ddp = DDPConfig(bucket_size=3000, use_distributed_optimizer=distributed)
    return train_tiny_lm(layout, steps=LAYOUT_STEPS, ddp=ddp, optimizer=optimizer).params


LAYOUTS = {
    "tp2 + sp": (ParallelConfig(tp=2, sequence_parallel=True), False),
    "dp2, distributed optimizer": (ParallelConfig(), True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_muon_layouts_equal_one_process(worlds, layout):
    reference = _train(ParallelConfig(), False)
    results = worlds.run(2, _train, *LAYOUTS[layout])
    for name, expected in reference.items():
        assert max_relative_error(results[0][name], expected) < 1e-5, f"{layout}: {name}"
