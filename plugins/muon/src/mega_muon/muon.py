"""Muon (momentum orthogonalised by Newton-Schulz) for the hidden matrices, AdamW for the rest.

``--optimizer muon`` builds one :class:`MuonWithAdamW`: its param groups are tagged ``muon``
(hidden weight matrices) or not (embeddings, output layer, router, norms, biases: AdamW, as in
Megatron-LM, Moonlight and Kimi K2). A Muon step on one matrix ``W`` with gradient ``G``:

    M <- lerp(M, G, 1 - momentum)                       (the momentum buffer, EMA form)
    U <- lerp(G, M, momentum) if nesterov else M
    O <- NewtonSchulz(U) * scale(rows, cols) * extra     (per logical matrix, see mega_muon.layout)
    W <- W * (1 - lr * weight_decay) - lr * O

Newton-Schulz needs the whole matrix, whereas a rank holds a tensor-parallel shard, a ZeRO-1 flat
slice or an FSDP2 row shard of it: :mod:`mega_muon.layout` assembles the matrix, splits
fused QKV / gate-up weights and grouped experts into their logical matrices, and hands back this
rank's part of the result. The momentum is element-wise, so it stays sharded like Adam's moments
(and checkpoints reshard it the same way).

Flag names and defaults follow Megatron-LM (``--muon-momentum``, ``--muon-use-nesterov``,
``--muon-num-ns-steps``, ``--muon-scale-mode``, ``--muon-fp32-matmul-prec``,
``--muon-extra-scale-factor``, ``--muon-no-split-qkv``); coefficient sets and scale modes are
those of NVIDIA's emerging_optimizers, which Megatron-LM calls (``medium`` precision iterates in
bfloat16, as ``torch.optim.Muon`` does).
"""

from __future__ import annotations

import math

import torch

from mega.core.optim.config import OptimizerConfig
from mega.core.optim.torch_optimizers import adamw_kernel
from mega_muon.layout import MuonLayout, muon_param_groups

# (a, b, c) of each quintic step X <- a X + (b A + c A^2) X, A = X X^T, by coefficient type.
COEFFICIENTS: dict[str, tuple[tuple[float, float, float], ...]] = {
    # Keller Jordan's, torch.optim.Muon's: one set, repeated.
    "simple": ((3.4445, -4.7750, 2.0315),),
    # modded-nanogpt's per-step sets (emerging_optimizers' and Megatron's default).
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
    # Polar Express (arXiv:2505.16932); its last set repeats past 8 steps.
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),
}
EPS = 1e-7


def coefficient_schedule(kind: str, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of ``steps`` Newton-Schulz iterations."""
    if kind not in COEFFICIENTS:
        raise ValueError(f"--muon-coefficient-type {kind!r}: choose one of {', '.join(COEFFICIENTS)}")
    if steps < 1:
        raise ValueError(f"--muon-num-ns-steps must be >= 1, got {steps}")
    sets = list(COEFFICIENTS[kind])
    if kind == "simple":
        return sets * steps
    if kind == "polar_express":
        if steps < len(sets):
            raise ValueError(f"--muon-coefficient-type polar_express needs --muon-num-ns-steps >= {len(sets)}")
        return sets + [sets[-1]] * (steps - len(sets))
    if steps % len(sets):
        raise ValueError(f"--muon-coefficient-type {kind} needs --muon-num-ns-steps a multiple of {len(sets)}")
    return sets * (steps // len(sets))


def newton_schulz(matrix: torch.Tensor, schedule: list[tuple[float, float, float]],
                  precision: str = "medium") -> torch.Tensor:
    """An approximately orthogonal matrix with ``matrix``'s singular vectors (fp32 result).

    ``precision`` is Megatron's ``--muon-fp32-matmul-prec``: ``medium`` iterates in bfloat16,
    ``high`` in fp32 allowing TF32 on CUDA, ``highest`` in full fp32. The operations and their
    order are torch.optim.Muon's, so with the same coefficients the results are bit-identical."""
    if matrix.dim() != 2:
        raise ValueError(f"Newton-Schulz orthogonalises matrices, got shape {tuple(matrix.shape)}")
    x = matrix.bfloat16() if precision == "medium" else matrix.float()
    tall = matrix.size(0) > matrix.size(1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.T
    x = x.div(x.norm().clamp(min=EPS))
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "high" else "highest")
    try:
        for a, b, c in schedule:
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    finally:
        torch.set_float32_matmul_precision(previous)
    return (x.T if tall else x).float()


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """Update scale of a ``rows`` x ``cols`` matrix (emerging_optimizers' modes)."""
    if mode == "spectral":  # Kimi/Moonlight: with --muon-extra-scale-factor 0.2 it matches AdamW's update RMS
        return math.sqrt(max(rows, cols))
    if mode == "shape_scaling":  # Keller Jordan's original (torch.optim.Muon's adjust_lr_fn="original")
        return math.sqrt(max(1.0, rows / cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    raise ValueError(f"--muon-scale-mode {mode!r}: choose spectral, shape_scaling or unit_rms_norm")


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the groups tagged ``muon``, AdamW (torch's own kernels) on the others; one state
    dict, so mega's checkpoints and wrappers see one optimizer.

    The distributed layout of each Muon parameter comes from :meth:`bind_layout` (called by
    :func:`~mega.core.optim.build.build_optimizer` once the main parameters exist); unbound, a
    parameter is a whole matrix (or a stack of them) on this rank."""

    def __init__(self, param_groups: list[dict], config: OptimizerConfig):
        self.config = config
        self.schedule = coefficient_schedule(config.muon_coefficient_type, config.muon_num_ns_steps)
        scale_factor(2, 1, config.muon_scale_mode)  # reject a bad mode now, not at the first step
        super().__init__(param_groups, {"lr": config.lr, "weight_decay": config.weight_decay, "muon": False})
        self.layout = None
        self._bind_adamw()

    def _bind_adamw(self) -> None:
        adam_groups = [g for g in self.param_groups if not g["muon"]]
        # Muon's main parameters, and its model parameters once bound (a checkpoint names state
        # from the model, also on ranks owning none of a parameter's state).
        self._muon_ids = {id(p) for g in self.param_groups if g["muon"] for p in g["params"]}
        if self.layout is not None:
            self._muon_ids |= {id(slot.model) for slot in self.layout.slots}
        devices = {p.device.type for g in adam_groups for p in g["params"]}
        # An AdamW over the same group dicts and the same state: lr set on our groups reaches it.
        self.adamw = None
        if any(g["params"] for g in adam_groups):
            self.adamw = torch.optim.AdamW(adam_groups, lr=self.config.lr,
                                           betas=(self.config.adam_beta1, self.config.adam_beta2),
                                           eps=self.config.adam_eps, weight_decay=self.config.weight_decay,
                                           **adamw_kernel(devices))
            self.adamw.state = self.state

    def bind_layout(self, layout) -> None:
        """``layout``: a :class:`~mega_muon.layout.MuonLayout` of this rank's Muon parameters."""
        self.layout = layout
        self._muon_ids |= {id(slot.model) for slot in layout.slots}

    def state_keys(self, param: torch.Tensor) -> tuple[str, ...]:
        """The per-element state ``param`` (a main or a model parameter) keeps: what checkpoints
        create before loading and expect a save to hold."""
        return ("momentum_buffer",) if id(param) in self._muon_ids else ("exp_avg", "exp_avg_sq")

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._bind_adamw()  # torch replaced the group dicts and the state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonWithAdamW.step takes no closure")
        if self.adamw is not None:
            self.adamw.step()
        muon_groups = [g for g in self.param_groups if g["muon"]]
        if not muon_groups:
            return None
        updates = {}  # main param -> this rank's part of the momentum-derived update
        momentum, nesterov = self.config.muon_momentum, self.config.muon_use_nesterov
        for group in muon_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                buffer = self.state[param].get("momentum_buffer")
                if buffer is None:
                    buffer = self.state[param]["momentum_buffer"] = torch.zeros_like(grad)
                buffer.lerp_(grad, 1 - momentum)
                updates[param] = grad.lerp(buffer, momentum) if nesterov else buffer
        orthogonalize = self._orthogonalize_one
        if self.layout is not None:
            results = self.layout.orthogonalize(updates, orthogonalize)
        else:
            results = {p: orthogonalize(u, None) for p, u in updates.items()}
        for group in muon_groups:
            lr = group["lr"] * group.get("lr_ratio", 1.0)
            for param in group["params"]:
                if param not in results:
                    continue
                ortho, scale = results[param]
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(ortho, alpha=-lr * scale)
        return None

    def _orthogonalize_one(self, update: torch.Tensor, blocks) -> tuple[torch.Tensor, float]:
        """Orthogonalise ``update`` (whole, at its full shape) matrix by logical matrix.

        ``blocks``: how its rows split into logical matrices (see layout.row_blocks); None for
        one matrix (or, for a 3-D tensor, one per expert). Returns the result and the scale still
        to apply (folded into the learning rate when it is the same for every part)."""
        config = self.config
        extra = config.muon_extra_scale_factor
        stack = update.unsqueeze(0) if update.dim() == 2 else update
        parts = []
        scales = set()
        for matrix in stack:
            pieces = [matrix] if blocks is None else blocks.split(matrix)
            outputs = []
            for piece in pieces:
                outputs.append(newton_schulz(piece, self.schedule, config.muon_fp32_matmul_prec))
                scales.add(scale_factor(piece.size(0), piece.size(1), config.muon_scale_mode) * extra)
            parts.append(outputs)
        if len(scales) == 1:
            scale = scales.pop()
        else:  # logical matrices of different shapes (Q, K, V): scale each here
            parts = [[o * (scale_factor(o.size(0), o.size(1), config.muon_scale_mode) * extra) for o in outputs]
                     for outputs in parts]
            scale = 1.0
        merged = [outputs[0] if blocks is None else blocks.merge(outputs) for outputs in parts]
        result = merged[0] if update.dim() == 2 else torch.stack(merged)
        return result.to(update.dtype), scale


def muon(param_groups: list[dict], config: OptimizerConfig) -> torch.optim.Optimizer:
    """The ``--optimizer muon`` factory (groups from :func:`muon_param_groups`)."""
    return MuonWithAdamW(param_groups, config)


def bind_layout(models, optimizer, groups, config: OptimizerConfig) -> None:
    """Once the wrapper holds the main parameters: where each Muon matrix's other shards are."""
    optimizer.optimizer.bind_layout(MuonLayout.of(models, optimizer, groups, config))


# build_optimizer's seam for a registered optimizer: Muon's matrices apart from AdamW's groups,
# and the layout bound after the wrapper is built.
muon.param_groups = muon_param_groups
muon.after_build = bind_layout
