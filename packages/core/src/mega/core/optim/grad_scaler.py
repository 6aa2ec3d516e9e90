"""Loss scaling for fp16: keep small gradients representable, back off when they overflow.

:class:`DynamicGradScaler` follows Megatron's rules (and defaults): start at ``2**32``; a step
whose gradients hold an inf or NaN is skipped and uses up one unit of ``hysteresis``; once it is
used up, every such step multiplies the scale by ``backoff_factor`` (never below ``min_scale``).
After ``growth_interval`` clean steps in a row the scale grows by ``growth_factor`` and the
hysteresis is restored.
"""

from __future__ import annotations


class ConstantGradScaler:
    """A fixed loss scale (Megatron's ``--loss-scale``)."""

    def __init__(self, scale: float):
        if scale <= 0:
            raise ValueError(f"loss scale must be positive, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    def __init__(self, initial_scale: float = 2.0**32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        if not (initial_scale > 0 and min_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1):
            raise ValueError(
                f"bad loss-scaler settings: initial_scale={initial_scale}, min_scale={min_scale}, "
                f"growth_factor={growth_factor} (> 1), backoff_factor={backoff_factor} (in (0, 1))"
            )
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"growth_interval ({growth_interval}) and hysteresis ({hysteresis}) must be >= 1")
        self.scale = float(initial_scale)
        self.min_scale, self.growth_factor, self.backoff_factor = min_scale, growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._clean_steps = 0
        self._hysteresis_left = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self._clean_steps = 0
            self._hysteresis_left = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
