"""LoRA in `mega train`: its flags, and the setup pass that adapts every model chunk.

The flags are this package's plugin options (``run_config.plugins["models"]``): ``--lora-rank``
(0: no LoRA), ``--lora-alpha``, ``--lora-dropout``, ``--lora-target-modules``. The setup pass
(phase ``ADAPTERS``, :mod:`mega.core.setup_passes`) runs :func:`mega.models.lora.adapters.apply_lora` on
each chunk after the parallel layout and before FP8, compile, data parallelism and the optimizer
see it, so only the adapters are trained, reduced and kept in the optimizer.
The adapters are marked ``checkpoint_optional``: ``--load`` of a base model starts fresh adapters on
it, checkpoints of the run hold the adapters alone, and ``--load BASE --load-adapter DIR`` resumes
them (mega.core.checkpoint.adapters).
"""

from __future__ import annotations

from dataclasses import dataclass

from mega.core.config import ConfigError
from mega.core.config.options import option
from mega.core.setup_passes import ModelSetup, Phase, SetupPass, per_chunk

PLUGIN = "models"  # the entry-point name: run_config.plugins[PLUGIN], a [models] table in --config


@dataclass
class LoRAOptions:
    lora_rank: int = option(0, "LoRA: rank of the adapters beside the linear layers (0: no LoRA; the base is "
                            "frozen and only adapters train)")
    lora_alpha: float = option(32.0, "LoRA: the adapters' output is scaled by alpha / rank")
    lora_dropout: float = option(0.0, "LoRA: dropout on the adapters' input")
    lora_target_modules: list[str] | None = option(
        None, "LoRA: layers to adapt among linear_qkv, linear_proj, linear_fc1, linear_fc2, or all-linear "
        "(the default)")

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            raise ValueError(f"--lora-rank must be >= 0, got {self.lora_rank}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_rank:
            # start-up cost: the plugin's options load at discovery; the adapters' code when a run uses them
            from mega.models.lora.adapters import LoRAError, lora_targets

            try:
                lora_targets(self.lora_target_modules)
            except LoRAError as error:
                raise ValueError(str(error)) from None

    def settings(self):
        # start-up cost, as above
        from mega.models.lora.adapters import LoRASettings, lora_targets

        return LoRASettings(self.lora_rank, self.lora_alpha, self.lora_dropout, lora_targets(self.lora_target_modules))


def lora_setup_pass(settings, seed: int) -> SetupPass:
    """:func:`~mega.models.lora.adapters.apply_lora` of ``settings`` (a ``LoRASettings``) on every chunk."""

    def adapt(stage, setup: ModelSetup) -> None:
        # start-up cost, as above
        from mega.models.lora.adapters import LoRAError, apply_lora

        try:
            apply_lora(stage, settings, seed)
        except LoRAError as error:
            raise ConfigError(str(error)) from None

    return per_chunk("lora", Phase.ADAPTERS, adapt)


def lora_pass(run_config) -> SetupPass | None:
    """The run's LoRA pass when ``--lora-rank`` is set, None otherwise."""
    options = run_config.plugins.get(PLUGIN)
    if options is None or not options.lora_rank:
        return None
    checkpoint = run_config.checkpoint
    if checkpoint.save and not checkpoint.load:
        raise ConfigError("--lora-rank with --save but no --load: checkpoints of a LoRA run hold the adapters "
                          "alone, so the base model must come from --load")
    return lora_setup_pass(options.settings(), run_config.training.seed)
