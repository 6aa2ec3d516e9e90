"""Writing Megatron-LM's legacy checkpoints (``--ckpt-format torch``): one rank's
``model_optim_rng.pt`` dict at a time, each tensor split from the global one, the model state dict
in megatron-core's parameter order when the optimizer's state goes with it.
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from pathlib import Path

import torch

from mega.ckpt_convert.megatron.args import args_for
from mega.ckpt_convert.megatron.directory import (
    CHECKPOINT_VERSION,
    RANK_FILE,
    TRACKER_FILE,
    iteration_dir_name,
    rank_dir_name,
)
from mega.ckpt_convert.megatron.layout import (
    TensorLayout,
    expert_layout,
    fit_rows,
    model_layouts,
    stage_layers,
    stage_of,
)
from mega.ckpt_convert.megatron.legacy_optimizer import rank_optimizer
from mega.ckpt_convert.megatron.names import (
    MegatronNames,
    expert_of_file_key,
    names_for,
    split_stack_layer,
    stack_sizes,
)
from mega.ckpt_convert.megatron.param_order import ORDERS


def _extra_state_keys(names: MegatronNames, layouts, stage_sizes: dict[str, int], last_stage: bool,
                      experts: int) -> list[str]:
    """The ``_extra_state`` entries of one stage's state dict (``stage_sizes``: stack -> its layers there)."""
    keys = []
    for stack, layers in stage_sizes.items():
        modules = [module for module in names.extra_state_layer_modules if f"{stack}0.{module}.weight" in layouts]
        modules += [names.expert_file_name.format(expert=e, part=part)
                    for e in range(experts) for part in names.expert_extra_state_parts]
        keys += [f"{stack}{n}.{module}._extra_state" for n in range(layers) for module in modules]
    return keys + ([f"{module}._extra_state" for module in names.extra_state_modules] if last_stage else [])


class _LegacyWriter:
    """The rank files of ``source`` at tp x pp, one at a time."""

    def __init__(self, source, family, tp: int, pp: int, optimizer):
        self.source, self.family, self.tp, self.pp, self.optimizer = source, family, tp, pp, optimizer
        config = self.config = source.config
        self.layouts: dict[str, TensorLayout] = model_layouts(family, config, tp)
        self.names = names_for(family.name)
        self.stages = stage_layers(config.num_layers, pp)
        self.whole_stacks = stack_sizes(self.names, self.layouts)
        tied = not config.untie_embeddings_and_output_weights
        self.placements = {name: stage_of(name, self.stages, tied, self.names.stacks[0]) for name in self.layouts}
        # Experts' state is read stacked and written an expert at a time: the last few stacks are kept.
        self.stacked_state = functools.lru_cache(maxsize=8)(lambda name, key: source.get_optimizer(name, key))
        self._owners: dict[int, dict[str, str]] = {}

    def model(self, stage: int, rank: int) -> OrderedDict:
        """Rank ``rank``'s state dict of pipeline stage ``stage`` (without ``_extra_state``)."""
        source, names, tp = self.source, self.names, self.tp
        model = OrderedDict()
        for name, layout in self.layouts.items():
            for where, key in self.placements[name]:
                if where != stage:
                    continue
                tensor = source.get(name)
                if layout.padded_vocab:
                    tensor = fit_rows(tensor, layout.shape[0])
                prefix, _, part = key.rpartition("mlp.experts.")
                if names.expert_patterns and prefix and part.startswith("linear_fc"):
                    # one key per expert, each split over the tensor-parallel ranks as a dense MLP
                    split = expert_layout(name, self.config).split
                    for expert, weight in enumerate(tensor.to(source.dtype(name))):
                        model[prefix + names.expert_file_name.format(expert=expert, part=part)] = \
                            split(weight, rank, tp).clone()
                    continue
                model[key] = layout.split(tensor, rank, tp).to(source.dtype(name)).clone()
        for key, name in names.duplicate_keys.items():
            if name in model:
                model[key] = model[name]
        return model

    def owners(self, stage: int) -> dict[str, str]:
        """Key in stage ``stage``'s files -> the mega name it holds."""
        if stage not in self._owners:
            self._owners[stage] = {key: name for name in self.layouts for where, key in self.placements[name]
                                   if where == stage}
        return self._owners[stage]

    def state_of(self, key: str, stage: int, rank: int) -> dict[str, torch.Tensor]:
        """The optimizer state of the parameter ``key`` of stage ``stage``'s files, rank ``rank``'s shard."""
        source, tp, keys = self.source, self.tp, self.optimizer.keys
        owners = self.owners(stage)
        expert = expert_of_file_key(self.names, key)
        if expert is not None:  # one expert of the stacked tensor
            stack, number, _ = split_stack_layer(key)
            name = owners[f"{stack}{number}.{expert[0]}"]
            split = expert_layout(name, self.config).split
            return {k: split(self.stacked_state(name, k)[expert[1]], rank, tp) for k in keys}
        name = owners[key]
        layout = self.layouts[name]
        tensors = {k: source.get_optimizer(name, k) for k in keys}
        return {k: layout.split(fit_rows(t, layout.shape[0]) if layout.padded_vocab else t, rank, tp)
                for k, t in tensors.items()}

    def rank_state(self, stage: int, rank: int, args, iteration: int | None) -> dict:
        """What ``model_optim_rng.pt`` of (``rank``, ``stage``) holds."""
        names, optimizer = self.names, self.optimizer
        model = self.model(stage, rank)
        parameters = [(key, value) for key, value in model.items() if key not in names.duplicate_keys]
        if optimizer is not None:  # indices follow the model's parameter order: megatron-core's
            parameters.sort(key=lambda item: ORDERS[self.family.name].key(item[0]))
            model = OrderedDict(parameters + [(key, value) for key, value in model.items()
                                              if key in names.duplicate_keys])
        experts = getattr(self.config, "num_experts", 0) if names.expert_patterns else 0
        stage_sizes = {names.stacks[0]: len(self.stages[stage])} if self.pp > 1 else self.whole_stacks
        for key in _extra_state_keys(names, self.layouts, stage_sizes, stage == self.pp - 1, experts):
            model[key] = None
        state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration or 0, "model": model}
        if optimizer is not None:
            # One optimizer, experts too: megatron-core chains a second for them only under expert parallelism.
            state["optimizer"] = rank_optimizer(parameters, functools.partial(self.state_of, stage=stage, rank=rank),
                                                optimizer)
            if "schedule" in optimizer.hyperparameters:  # Megatron-LM's load_checkpoint requires it
                state["opt_param_scheduler"] = optimizer.hyperparameters["schedule"]
        return state


def write_legacy(source, family, directory: Path, tp: int, pp: int, iteration: int | None, optimizer=None) -> None:
    """``source`` as Megatron-LM's legacy files at tp x pp in ``directory`` (a new save directory);
    with ``optimizer`` (the source's :class:`~mega.ckpt_convert.optimizer_state.OptimizerState`),
    each rank's regular-optimizer state too, its model state dict in megatron-core's parameter order."""
    writer = _LegacyWriter(source, family, tp, pp, optimizer)
    config = source.config
    args = args_for(config, tp, pp, config.padded_vocab_size(tp), iteration or 0, "torch", source.tokenizer)
    if optimizer is not None:
        args.consumed_train_samples = optimizer.consumed_samples
    checkpoint_dir = directory / iteration_dir_name(iteration)
    for stage in range(pp):
        for rank in range(tp):
            path = checkpoint_dir / rank_dir_name(rank, stage, pp) / RANK_FILE
            path.parent.mkdir(parents=True)
            state = writer.rank_state(stage, rank, args, iteration)
            with open(path, "wb") as stream:
                torch.save(state, stream)
                stream.flush()
                os.fsync(stream.fileno())
            del state
    (directory / TRACKER_FILE).write_text(f"{iteration if iteration is not None else 'release'}\n")
