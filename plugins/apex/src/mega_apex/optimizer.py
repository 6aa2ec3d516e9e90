"""``--optimizer apex-adam``: apex's FusedAdam, keeping its step count where torch's Adam does.

FusedAdam counts steps per parameter group (``group["step"]``); torch's Adam, and so mega's
checkpoints, per parameter (``state[p]["step"]``, saved next to ``exp_avg`` and ``exp_avg_sq``).
Mirroring the count into each parameter's state after a step, and back into the group before
one, lets a run resume with the right bias correction from a checkpoint either optimizer wrote.
"""

from __future__ import annotations

import torch


def fused_adam(param_groups: list[dict], config) -> torch.optim.Optimizer:
    # optional dependency: the kernel library may be absent; the backend reports it
    from apex.optimizers import FusedAdam

    class CheckpointableFusedAdam(FusedAdam):
        def step(self, closure=None):
            for group in self.param_groups:
                steps = [self.state[p]["step"] for p in group["params"] if "step" in self.state.get(p, {})]
                if steps:  # loaded from a checkpoint (or a previous step): continue its count
                    group["step"] = int(max(float(step) for step in steps))
            loss = super().step(closure)
            for group in self.param_groups:
                for param in group["params"]:
                    if self.state.get(param):
                        self.state[param]["step"] = torch.tensor(float(group["step"]))
            return loss

    return CheckpointableFusedAdam(param_groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                   eps=config.adam_eps, weight_decay=config.weight_decay, adam_w_mode=True)
