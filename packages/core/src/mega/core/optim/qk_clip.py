"""QK-clip (Kimi K2's MuonClip; Megatron-LM's ``--qk-clip``): keep attention logits bounded by
scaling the query and key projections down after an optimizer step.

During the forward passes of a step, each self-attention layer's largest logit
``max q_i . k_j * softmax_scale`` is recorded per head (over the keys each query may see: causal
and padding masks; packed sequences count all pairs of a row, which can only clip more). After
the inner optimizer's step - before the new weights go back to the model (and, under ZeRO-1,
before they are all-gathered) - the maxima are reduced (MAX) over the data-parallel and context
ranks, and per query group ``g`` (Megatron's rule for grouped-query attention)

    eta_g = min(threshold / max over the group's heads, 1)
    W_q[g] *= eta_g ** alpha,   W_k[g] *= eta_g ** (1 - alpha)

on this rank's part of the fp32 main weights of the fused QKV projection (tensor shard, ZeRO-1
flat slice or FSDP2 rows). Every tensor rank holds its own heads' rows, so no tensor-parallel
communication is needed.

Attention layers are found by what they have (``linear_qkv``, ``core_attention``,
``queries_per_group``, ``head_dim``: mega's and Megatron's fused per-group layout), so the core
names no model package.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mega.core.parallel.groups import ParallelGroups


def attention_layers(models: list[nn.Module]) -> list[nn.Module]:
    return [module for model in models for module in model.modules()
            if all(hasattr(module, a) for a in ("linear_qkv", "core_attention", "queries_per_group", "head_dim"))]


def head_max_logits(query: torch.Tensor, key: torch.Tensor, scale: float, causal: bool,
                    padding: torch.Tensor | None) -> torch.Tensor:
    """Per query head, the largest ``q . k * scale`` a query may attend to. ``query``
    ``[s, b, heads, d]``, ``key`` ``[t, b, groups, d]`` (heads grouped consecutively)."""
    s, b, heads, d = query.shape
    groups = key.shape[2]
    q = query.float().view(s, b, groups, heads // groups, d)
    logits = torch.einsum("sbgpd,tbgd->bgpst", q, key.float()) * scale
    allowed = torch.ones(s, key.shape[0], dtype=torch.bool, device=query.device)
    if causal:
        allowed = allowed.tril(key.shape[0] - s)
    allowed = allowed.view(1, 1, 1, s, -1)
    if padding is not None:
        allowed = allowed & padding.view(b, 1, 1, 1, -1)
    logits = logits.masked_fill(~allowed, float("-inf"))
    return logits.amax(dim=(0, 3, 4)).reshape(heads)


class QKClip:
    """Records the layers' maximum logits and clips after each inner optimizer step."""

    def __init__(self, models: list[nn.Module], wrapper, groups: ParallelGroups, threshold: float, alpha: float):
        if threshold <= 0 or not 0 < alpha < 1:
            raise ValueError(f"--qk-clip needs --qk-clip-threshold > 0 (got {threshold}) and "
                             f"0 < --qk-clip-alpha < 1 (got {alpha})")
        if groups.cp.size > 1:
            raise ValueError("--qk-clip: the maximum logit over context-parallel sequence chunks is not recorded; "
                             "run it without --context-parallel-size")
        self.threshold, self.alpha, self.groups = threshold, alpha, groups
        self.layers = attention_layers(models)
        if not self.layers:
            raise ValueError("--qk-clip: the model has no self-attention layer with a fused per-group QKV "
                             "projection (linear_qkv) to clip")
        entries = {id(entry.model): entry for entry in wrapper.main_params}
        self.entries = [entries.get(id(layer.linear_qkv.weight)) for layer in self.layers]
        self.maxima: list[torch.Tensor | None] = [None] * len(self.layers)
        self.last_max_logit = 0.0
        for index, layer in enumerate(self.layers):
            layer.core_attention.register_forward_pre_hook(self._recorder(index))
        wrapper.optimizer.register_step_post_hook(lambda *_: self.clip())

    def _recorder(self, index: int):
        def record(module: nn.Module, args) -> None:
            if not module.training:
                return  # evaluation and generation (a recompute's second forward finds the same maxima)
            query, key = args[0], args[1]
            mask = args[3] if len(args) > 3 else None
            scale = getattr(module, "softmax_scale", None) or query.shape[-1] ** -0.5
            with torch.no_grad():
                found = head_max_logits(query.detach(), key.detach(), scale, getattr(mask, "causal", True),
                                        getattr(mask, "padding", None))
            seen = self.maxima[index]
            self.maxima[index] = found if seen is None else torch.maximum(seen, found)

        return record

    @torch.no_grad()
    def clip(self) -> None:
        dp = self.groups.dp_cp
        overall = 0.0
        for index, layer in enumerate(self.layers):
            heads = layer.linear_qkv.weight.shape[-2] // ((layer.queries_per_group + 2) * layer.head_dim) \
                * layer.queries_per_group
            maxima = self.maxima[index]
            if maxima is None:  # no forward this step on this rank (every rank reduces all the same)
                maxima = torch.full((heads,), float("-inf"), device=layer.linear_qkv.weight.device)
            if dp.size > 1:
                dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=dp.group)
            self.maxima[index] = None
            overall = max(overall, maxima.max().item())  # (the largest logit, for whoever logs it)
            largest = maxima.view(-1, layer.queries_per_group).amax(dim=1)
            # (-inf where no rank saw a forward: nothing to clip)
            eta = torch.where(largest > self.threshold, self.threshold / largest, torch.ones_like(largest))
            if bool((eta < 1).any()) and self.entries[index] is not None:
                self._scale(self.entries[index], self._row_scales(layer, eta))
        self.last_max_logit = overall

    def _row_scales(self, layer: nn.Module, eta: torch.Tensor) -> torch.Tensor:
        """One factor per row of this rank's fused QKV weight: q rows eta^alpha, k rows
        eta^(1-alpha), v rows 1, group by group."""
        d, per_group = layer.head_dim, layer.queries_per_group
        q = (eta ** self.alpha)[:, None].expand(-1, per_group * d)
        k = (eta ** (1 - self.alpha))[:, None].expand(-1, d)
        return torch.cat([q, k, torch.ones_like(k)], dim=1).reshape(-1)

    @staticmethod
    def _scale(entry, rows: torch.Tensor) -> None:
        main = entry.main
        if hasattr(main, "device_mesh"):  # FSDP2: this rank's rows of the (tensor-parallel) weight
            # Start-up cost: DTensor's import takes a second; only FSDP runs, which have it, get here.
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local = main.to_local()
            _, offsets = compute_local_shape_and_global_offset(main.shape, main.device_mesh, main.placements)
            local.mul_(rows[offsets[0]:offsets[0] + local.shape[0], None].to(local.dtype))
        elif entry.flat_range is not None:  # ZeRO-1: a flat slice of the weight
            lo, hi = entry.flat_range
            cols = entry.model.shape[-1]
            main.view(-1).mul_(rows.repeat_interleave(cols)[lo:hi].to(main.dtype))
        else:
            main.mul_(rows[:, None].to(main.dtype))
