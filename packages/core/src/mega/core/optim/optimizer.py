"""Mixed-precision optimizer: a torch optimizer stepping fp32 main parameters of a split model.

One step, as in Megatron:

1. take each parameter's gradient (``main_grad`` from :class:`DistributedDataParallel`, else
   ``grad``) as the fp32 gradient of its main parameter;
2. divide by the loss scale (fp16);
3. compute the global gradient norm over every tp/pp/dp/ep shard, each element once
   (:mod:`mega.core.optim.clip_grads`); if it is inf or NaN the step is skipped and counted, the
   loss scale backs off, and no parameter changes;
4. clip by the global norm; let the inner optimizer (AdamW, ...) update the main parameters;
5. copy them back into the model's (bf16/fp16) parameters.

fp32 parameters are their own main parameters (no copy). :class:`MixedPrecisionOptimizer`
keeps whole main parameters on every rank; the ZeRO-1
:class:`~mega.core.optim.distributed_optimizer.DistributedOptimizer` keeps only this rank's
shard of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mega.core.optim.clip_grads import clip_by_norm_, global_norm, owns_gradient
from mega.core.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from mega.core.parallel.groups import ParallelGroups

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


@dataclass(frozen=True)
class StepResult:
    applied: bool  # False when the gradients held an inf/NaN and the step was skipped
    grad_norm: float  # before clipping; inf or nan on a skipped step
    loss_scale: float  # the scale the step's gradients carried (1.0 without loss scaling)


@dataclass
class MainParam:
    """An fp32 tensor the inner optimizer updates, and where it comes from and goes back to."""

    model: nn.Parameter  # the model parameter (for its attributes: tensor parallel, expert, ...)
    main: nn.Parameter
    grad: Callable[[], torch.Tensor | None]  # this step's gradient of ``main``, any dtype
    model_view: torch.Tensor | None  # model storage to copy ``main`` back into; None if shared
    # The elements of the flattened model parameter ``main`` holds (the distributed optimizer's
    # slice); None when it holds the whole parameter in the parameter's shape.
    flat_range: tuple[int, int] | None = None


class MixedPrecisionOptimizer:
    """Full (not sharded) fp32 main parameters; the base of the distributed optimizer."""

    dp_sharded = False  # are gradients (and main parameters) split over data-parallel ranks?

    def __init__(self, param_groups: list[dict], groups: ParallelGroups, make_optimizer: OptimizerFactory,
                 *, clip_grad: float = 0.0, grad_scaler: ConstantGradScaler | DynamicGradScaler | None = None):
        self.groups, self.clip_grad, self.grad_scaler = groups, clip_grad, grad_scaler
        self.skipped_steps = 0
        self.main_params: list[MainParam] = []
        main_groups = []
        for group in param_groups:
            mains = []
            for param in group["params"]:
                for entry in self._main_params_of(param):
                    self.main_params.append(entry)
                    mains.append(entry.main)
            main_groups.append({**group, "params": mains})
        self.optimizer = make_optimizer(main_groups)

    def _main_params_of(self, param: nn.Parameter) -> list[MainParam]:
        def grad() -> torch.Tensor | None:
            main_grad = getattr(param, "main_grad", None)
            return main_grad if main_grad is not None else param.grad

        if param.dtype == torch.float32:
            return [MainParam(param, param, grad, None)]
        main = nn.Parameter(param.detach().float().clone())
        return [MainParam(param, main, grad, param)]

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (learning-rate schedulers set ``lr`` here)."""
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (multiplied by the fp16 loss scale)."""
        return loss * self.loss_scale if self.grad_scaler is not None else loss

    def zero_grad(self) -> None:
        """Drop ``.grad`` of model and main parameters (DDP's buffers: ``ddp.zero_grad_buffer()``)."""
        for entry in self.main_params:
            entry.model.grad = None
            entry.main.grad = None

    @torch.no_grad()
    def step(self) -> StepResult:
        scale = self.loss_scale
        with_grads = []
        for entry in self.main_params:
            grad = entry.grad()
            entry.main.grad = None if grad is None else grad.float()  # no copy when already fp32
            if grad is not None:
                with_grads.append(entry)
        grads = [entry.main.grad for entry in with_grads]
        if scale != 1.0:
            for grad in grads:
                grad.mul_(1.0 / scale)

        grad_norm = global_norm(self._owned_grads(with_grads), self.groups)
        found_inf = not math.isfinite(grad_norm)
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf)
        if found_inf:
            self.skipped_steps += 1
            self.zero_grad()
            return StepResult(False, grad_norm, scale)

        if self.clip_grad > 0:
            clip_by_norm_(grads, self.clip_grad, grad_norm)
        self.optimizer.step()
        self.zero_grad()  # fp32 params are their own main params: never leave a stale .grad behind
        self._copy_main_to_model()
        return StepResult(True, grad_norm, scale)

    def _owned_grads(self, with_grads: list[MainParam]) -> list[torch.Tensor]:
        """The gradients this rank counts in the global norm (each element of the model once)."""
        return [e.main.grad for e in with_grads if owns_gradient(e.model, self.groups, self.dp_sharded)]

    def _copy_main_to_model(self) -> None:
        for entry in self.main_params:
            if entry.model_view is not None:
                entry.model_view.copy_(entry.main.detach().view_as(entry.model_view))

    def state_bytes(self) -> int:
        """Memory this rank spends on optimizer state: main-parameter copies and the inner state."""
        copies = sum(e.main.numel() * e.main.element_size() for e in self.main_params if e.model_view is not None)
        inner = sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                    for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
        return copies + inner
