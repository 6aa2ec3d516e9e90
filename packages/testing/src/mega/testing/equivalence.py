"""Train the tiny LM on a layout, or plainly on one process, and report what equivalence tests compare.

``train_tiny_lm`` is the whole mega path: split with the plan, wrap in
:class:`DistributedDataParallel`, step :func:`build_optimizer`'s optimizer, micro-batches under
``no_sync``. ``reference_train`` is the same model and data with nothing of ours around it:
``loss.backward()``, ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW``. Both return
full (unsplit) tensors, so a test compares them name by name.

``assert_matches`` compares two results: losses and gradient norms step by step, gradients
element-wise (largest difference relative to the largest reference value), parameters in norm
(``||p - ref|| / ||ref||``): Adam divides by ``sqrt(v)``, so an element whose gradient is
almost zero turns fp32 summation-order noise into a visible step; the norm keeps such an
element from dominating while a wrongly updated row still shows.

Data: step ``i`` uses ``make_batch(config, batch, seed + i)``; data-parallel rank ``r`` takes the
``r``-th equal slice of the rows and splits it into ``micro_batches``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from mega.core.distributed.ddp import DDPConfig, DistributedDataParallel
from mega.core.optim.build import build_optimizer
from mega.core.optim.config import OptimizerConfig
from mega.core.parallel.collectives import all_reduce
from mega.core.parallel.config import ParallelConfig
from mega.core.parallel.groups import ParallelGroups
from mega.core.parallel.layers import gather_shards
from mega.core.parallel.param_attrs import is_tensor_parallel
from mega.core.parallel.tensor_parallel import apply_tensor_parallel
from mega.testing.tiny_lm import PLAN, TinyConfig, TinyLM, make_batch


@dataclass
class TrainResult:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]  # full tensors after the last step, fp32
    first_grads: dict[str, torch.Tensor] | None = None  # full reduced gradients of step 0
    applied: list[bool] = field(default_factory=list)
    loss_scales: list[float] = field(default_factory=list)
    state_bytes: int = 0


def full_tensor(tensor: torch.Tensor, param: nn.Parameter, groups: ParallelGroups) -> torch.Tensor:
    """``tensor`` (a parameter or its gradient) as one process holds it: tensor shards gathered."""
    if is_tensor_parallel(param):
        tensor = gather_shards(tensor, groups.tp, param.partition_dim, param.partition_chunks)
    return tensor.detach().float().clone()


def train_tiny_lm(layout: ParallelConfig = ParallelConfig(), *, steps: int = 3, batch: int = 4,
                  micro_batches: int = 1, ddp: DDPConfig = DDPConfig(bucket_size=2000),
                  optimizer: OptimizerConfig = OptimizerConfig(lr=1e-2), dtype: torch.dtype = torch.float32,
                  config: TinyConfig = TinyConfig(), seed: int = 0, poison_step: int | None = None,
                  skip_steps: tuple[int, ...] = (), events=None, grad_scaler=None) -> TrainResult:
    """Train on this process's part of ``layout``; ``poison_step`` makes rank 0's gradients NaN there."""
    groups = ParallelGroups(layout)
    torch.manual_seed(seed)
    module = apply_tensor_parallel(TinyLM(config), PLAN, groups).to(dtype)
    model = DistributedDataParallel(module, groups, ddp, events=events)
    opt = build_optimizer([model], groups, optimizer, grad_scaler)
    dp, dp_rank = groups.dp_cp.size, groups.dp_cp.rank
    if batch % (dp * micro_batches):
        raise ValueError(f"batch {batch} does not split into dp={dp} x {micro_batches} micro-batches")
    rows = batch // dp
    result = TrainResult([], [], {})

    for step in range(steps):
        if step in skip_steps:
            continue
        tokens, labels = make_batch(config, batch, seed + step)
        tokens, labels = (t[dp_rank * rows:(dp_rank + 1) * rows].chunk(micro_batches) for t in (tokens, labels))
        model.zero_grad_buffer()
        total = torch.zeros(())
        for index, (micro_tokens, micro_labels) in enumerate(zip(tokens, labels, strict=True)):
            last = index == micro_batches - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = model(micro_tokens, micro_labels, groups.tp) / micro_batches
                if step == poison_step and groups.global_rank == 0:
                    loss = loss * float("nan")
                opt.scale_loss(loss).backward()
            total += loss.detach().float()
        model.finish_grad_sync()
        if step == 0 and not ddp.use_distributed_optimizer:
            result.first_grads = {name: full_tensor(p.main_grad, p, groups) for name, p in module.named_parameters()}
        outcome = opt.step()
        all_reduce(total, groups.dp_cp)
        result.losses.append(total.item() / dp)
        result.grad_norms.append(outcome.grad_norm)
        result.applied.append(outcome.applied)
        result.loss_scales.append(outcome.loss_scale)

    if hasattr(opt, "finish_param_sync"):
        opt.finish_param_sync()
    result.params = {name: full_tensor(p, p, groups) for name, p in module.named_parameters()}
    result.state_bytes = opt.state_bytes()
    return result


def reference_train(*, steps: int = 3, batch: int = 4, optimizer: OptimizerConfig = OptimizerConfig(lr=1e-2),
                    config: TinyConfig = TinyConfig(), seed: int = 0) -> TrainResult:
    """The same training on one process with plain PyTorch (AdamW, torch's norm clipping)."""
    tp = ParallelGroups(ParallelConfig()).tp  # a group of one: the cross-entropy is plain
    torch.manual_seed(seed)
    model = TinyLM(config)
    decay = [p for n, p in model.named_parameters() if not n.endswith(".bias") and p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1]
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": optimizer.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=optimizer.lr, betas=(optimizer.adam_beta1, optimizer.adam_beta2), eps=optimizer.adam_eps,
    )
    result = TrainResult([], [], {})
    for step in range(steps):
        tokens, labels = make_batch(config, batch, seed + step)
        adamw.zero_grad()
        loss = model(tokens, labels, tp)
        loss.backward()
        if step == 0:
            result.first_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        max_norm = optimizer.clip_grad if optimizer.clip_grad > 0 else float("inf")
        result.grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        adamw.step()
        result.losses.append(loss.item())
        result.applied.append(True)
    result.params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return result


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (in float64): "equal within 1e-5 relative" for a
    whole tensor."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def norm_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def assert_matches(result: TrainResult, reference: TrainResult, tol: float = 1e-5) -> None:
    """``result`` equals ``reference`` within ``tol`` relative (see the module docstring)."""
    for step, (loss, ref) in enumerate(zip(result.losses, reference.losses, strict=True)):
        assert abs(loss - ref) <= tol * abs(ref), f"step {step}: loss {loss} != {ref}"
    for step, (norm, ref) in enumerate(zip(result.grad_norms, reference.grad_norms, strict=True)):
        assert abs(norm - ref) <= tol * ref, f"step {step}: grad norm {norm} != {ref}"
    if result.first_grads is not None:
        for name, grad in result.first_grads.items():
            error = max_relative_error(grad, reference.first_grads[name])
            assert error <= tol, f"gradient of {name}: relative error {error:.2e}"
    assert result.params.keys() == reference.params.keys()
    for name, param in result.params.items():
        error = norm_relative_error(param, reference.params[name])
        assert error <= tol, f"parameter {name}: relative error {error:.2e}"
