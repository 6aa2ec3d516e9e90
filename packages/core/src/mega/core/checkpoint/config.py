"""``CheckpointConfig``: the checkpoint section of a training run (``--save``, ``--load`` and friends).

It sits here, with the code that reads it, so the checkpoint package needs nothing from training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mega.core.config import ConfigError
from mega.core.config.options import option


@dataclass
class CheckpointConfig:
    save: str | None = option(None, "directory to save checkpoints to")
    load: str | None = option(None, "checkpoint directory (or one iter_XXXXXXX in it) to resume or fine-tune from; "
                              "the run's model family, model config and tokenizer are the checkpoint's (flags may "
                              "change only what keeps its function: docs/finetuning.md)")
    save_interval: int | None = option(None, "save every N iterations (and at the end)")
    load_optim: bool = option(True, "do not load the optimizer state", flag="--no-load-optim")
    load_rng: bool = option(True, "do not load the RNG states", flag="--no-load-rng")
    finetune: bool = option(False, "load weights only and start at iteration 0")
    use_checkpoint_args: bool = option(False, "Megatron's flag, accepted: a run that loads a mega checkpoint always "
                                       "takes its model family, model config and tokenizer from it (flags given "
                                       "may change only what keeps its function: see docs/finetuning.md)")
    load_adapter: str | None = option(None, "LoRA: the adapters, with the optimizer and the run's progress, from "
                                      "this checkpoint of a LoRA run (which holds the adapters alone); the base "
                                      "weights from --load")
    allow_unused_tensors: bool = option(False, "--load of a foreign checkpoint (Megatron-LM, Hugging Face): "
                                        "leave out, with a warning, tensors its model does not use instead of "
                                        "refusing it")
    ckpt_format: Literal["torch_dist"] = option("torch_dist", "checkpoint format")
    keep_last: int | None = option(None, "keep only the K newest checkpoints")
    async_save: bool = option(False, "write checkpoints in the background")
    verify_checksums: bool = option(True, "do not compare the loaded checkpoint's files with their checksums "
                                    "(saves reading a huge checkpoint twice)", flag="--no-verify-checksums")

    def check(self) -> None:
        """The checkpoint flags' own combinations, before any work."""
        if self.save_interval is not None and self.save_interval < 1:
            raise ConfigError(f"--save-interval must be a positive number of iterations, got {self.save_interval}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(f"--keep-last must be at least 1, got {self.keep_last}")
        if (self.save_interval or self.async_save or self.keep_last) and not self.save:
            raise ConfigError("--save-interval, --async-save and --keep-last need --save DIR")
