"""Optimizer state carried by a conversion (``mega convert --with-optimizer``).

A source that holds Adam state offers it beside its weights: ``optimizer_state()`` returns an
:class:`OptimizerState` (or raises a :class:`ConversionError` saying why the input has none that
mega can carry), and ``get_optimizer(name, key)`` one global tensor, shaped like the parameter
``name`` (vocabulary rows padded or not, as the weights). Keys are mega's: ``exp_avg``,
``exp_avg_sq`` and, where the run kept fp32 copies of bf16/fp16 weights, ``main_param``
(Megatron's ``fp32_param``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mega.ckpt_convert.errors import ConversionError

MOMENTS = ("exp_avg", "exp_avg_sq")
MAIN_PARAM = "main_param"


@dataclass(frozen=True)
class OptimizerState:
    keys: tuple[str, ...]  # MOMENTS, and MAIN_PARAM when the source has fp32 main parameters
    step: int  # Adam's step count (bias correction), shared by every parameter
    iteration: int  # the training iteration the state belongs to
    consumed_samples: int = 0
    # lr, betas, eps, weight_decay of the run, where the source records them
    hyperparameters: dict = field(default_factory=dict)


def optimizer_state_of(source, what: str) -> OptimizerState:
    """``source``'s optimizer state, or one error saying the input has none to carry."""
    reader = getattr(source, "optimizer_state", None)
    if reader is None:
        raise ConversionError(f"--with-optimizer: {what} carries no optimizer state mega can read "
                              "(mega and Megatron-LM torch_dist checkpoints do)")
    return reader()
