"""Building a stage of a decoder-only LM, and the ``ModelFamily`` every such family shares.

GPT and LLaMA differ only in their presets; the block, the plan, the initialisation and the
formulas are the same code.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mega.core.model_family import HFMapping, ModelFamily
from mega.core.parallel import ParallelConfig
from mega.models.config import TransformerConfig
from mega.models.flops import num_floating_point_operations
from mega.models.initialization import init_parameters
from mega.models.language_model import LanguageModel
from mega.models.memory import stage_footprint
from mega.models.parallel_plan import tensor_parallel_plan
from mega.models.parameter_count import num_parameters

DEFAULT_SEED = 1234  # Megatron's --seed default


def build_language_model(config: TransformerConfig, *, pre_process: bool = True, post_process: bool = True,
                         layers: range | None = None, parallel: ParallelConfig | None = None,
                         rng_tracker=None, device: torch.device | str | None = None,
                         seed: int = DEFAULT_SEED) -> LanguageModel:
    """One stage, built on ``device`` (default: torch's default device) and initialised from
    ``seed``; on the ``meta`` device nothing is allocated (for counting and planning).

    ``parallel`` (tp, sequence_parallel) sets the vocabulary padding and where dropout forks
    into ``rng_tracker``'s model-parallel stream; the model itself stays single-device code, made
    parallel afterwards by ``apply_tensor_parallel`` with ``tensor_parallel_plan``.
    """
    device = torch.device(device) if device is not None else torch.get_default_device()
    with device:
        model = LanguageModel(config, pre_process=pre_process, post_process=post_process, layers=layers,
                              parallel=parallel, rng_tracker=rng_tracker)
    if device.type != "meta":
        init_parameters(model, seed)
    return model


def transformer_family(name: str, presets: Mapping[str, TransformerConfig], description: str,
                       hf_mapping: HFMapping | None = None) -> ModelFamily:
    return ModelFamily(
        name=name,
        config_class=TransformerConfig,
        presets=presets,
        build=build_language_model,
        tensor_parallel_plan=tensor_parallel_plan,
        init_parameters=init_parameters,
        num_parameters=num_parameters,
        num_floating_point_operations=num_floating_point_operations,
        description=description,
        hf_mapping=hf_mapping,
        memory_model=stage_footprint,
    )
