"""LoRA adapters between mega and Hugging Face PEFT: an adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads onto the transformers
model, and the merge of a mega checkpoint's adapters into its base weights.

mega's adapter of a layer (``<layer>.adapter.linear_in.weight`` A ``[rank, in]``,
``<layer>.adapter.linear_out.weight`` B ``[out, rank]``, ``<layer>.adapter.scaling`` alpha / rank)
becomes PEFT's ``lora_A`` / ``lora_B`` of each Hugging Face module the layer's weight maps to,
through the family's :class:`~mega.core.model_family.HFMapping`: B's rows are rearranged as the
weight's rows are (the fused QKV split into q/k/v, SwiGLU's ``[gate; up]`` into gate/up), and every
module of one fused layer gets the same A, so ``B_q A x`` is exactly the q rows of ``B A x``. GPT-2's
Conv1D layers hold their weights transposed (PEFT's ``fan_in_fan_out``); the adapter is not.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from mega.models.lora.adapters import merged_weight
from mega.models.lora.peft import PEFT_PREFIX, peft_scaling
from mega.models.lora.peft import (
    read_peft_adapter as read_peft_adapter,  # where mega lora import-peft reads it
)

ADAPTER = ".adapter."


def adapter_layers(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{layer: (A, B, scaling)}`` of the adapters among mega's global ``tensors``."""
    layers = {}
    for name in tensors:
        if name.endswith(".adapter.linear_in.weight"):
            layer = name[: -len(".adapter.linear_in.weight")]
            scaling = tensors.get(f"{layer}.adapter.scaling")
            if scaling is None:
                raise ValueError(f"{layer}: the adapter has no scaling (alpha / rank) beside it")
            layers[layer] = (tensors[name], tensors[f"{layer}.adapter.linear_out.weight"], float(scaling))
    return layers


def peft_tensors(mapping, config, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
    """PEFT's adapter tensors (``base_model.model.<module>.lora_A.weight``...) of mega's adapters, and
    whether the Hugging Face modules hold their weights transposed (``fan_in_fan_out``)."""
    layers = adapter_layers(tensors)
    maps = {tensor_map.mega[0]: tensor_map for tensor_map in mapping.tensor_maps(config) if len(tensor_map.mega) == 1}
    result, transposed = {}, False
    for layer, (a, b, _) in layers.items():
        tensor_map = maps.get(f"{layer}.weight")
        if tensor_map is None:
            raise ValueError(f"{layer}: {mapping.architecture} has no one weight this layer maps to")
        # B's rows go where the weight's rows go; a map that transposes (Conv1D) is undone for B.
        pieces = tensor_map.from_mega(b)
        for hf_name, piece in zip(tensor_map.other, pieces, strict=True):
            if piece.shape[0] == a.shape[0] and piece.shape[-1] != a.shape[0]:
                piece, transposed = piece.t(), True
            module = hf_name[: -len(".weight")]
            result[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.clone()  # one copy per module (safetensors)
            result[f"{PEFT_PREFIX}{module}.lora_B.weight"] = piece.contiguous()
    return result, transposed


def write_peft_adapter(directory: str | os.PathLike, mapping, config, tensors: Mapping[str, torch.Tensor],
                       dropout: float = 0.0, base_model: str | None = None) -> list[str]:
    """Write PEFT's adapter directory for mega's adapters in ``tensors`` (global names); returns
    the Hugging Face modules adapted."""
    # optional dependency: safetensors (the [test] extra, or with peft) reads and writes PEFT's files
    from safetensors.torch import save_file

    layers = adapter_layers(tensors)
    if not layers:
        raise ValueError("no LoRA adapters to export (no '<layer>.adapter.linear_in.weight' tensors)")
    ranks = {a.shape[0] for a, _, _ in layers.values()}
    scalings = {scaling for _, _, scaling in layers.values()}
    if len(ranks) != 1 or len(scalings) != 1:
        raise ValueError(f"PEFT's adapter config holds one rank and alpha; these adapters have ranks {sorted(ranks)} "
                         f"and scalings {sorted(scalings)}")
    rank, scaling = ranks.pop(), scalings.pop()
    peft, transposed = peft_tensors(mapping, config, tensors)
    modules = sorted({name[len(PEFT_PREFIX): -len(".lora_A.weight")] for name in peft if ".lora_A." in name})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": scaling * rank, "lora_dropout": dropout, "bias": "none",
        "fan_in_fan_out": transposed, "use_rslora": False, "inference_mode": True,
        # The exact modules, as one regular expression PEFT matches whole against module names.
        "target_modules": "|".join(re.escape(module) for module in modules),
    }
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.detach().cpu() for name, tensor in peft.items()}, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return modules


def merged_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """mega's global tensors with every adapter folded into its layer's weight (``W + B A * scaling``)
    and the adapters gone."""
    layers = adapter_layers(tensors)
    merged = {name: tensor for name, tensor in tensors.items() if ADAPTER not in name}
    for layer, (a, b, scaling) in layers.items():
        merged[f"{layer}.weight"] = merged_weight(merged[f"{layer}.weight"], a, b, scaling)
    return merged


def fold_peft_adapter(mapping, config, tensors: Mapping[str, torch.Tensor], adapter_config: Mapping,
                      peft: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """mega's global ``tensors`` with a PEFT adapter folded in: each Hugging Face module's
    ``B A * alpha / r`` (``/ sqrt(r)`` with rsLoRA) is a delta of its weight, which the family's
    tensor maps carry to mega's layout (q/k/v deltas into the fused QKV, gate/up into ``[gate; up]``)."""
    scaling = peft_scaling(adapter_config)
    deltas = {}
    for name, a in peft.items():
        if ".lora_A." not in name:
            continue
        module = name.removeprefix(PEFT_PREFIX).rsplit(".lora_A.", 1)[0]
        delta = peft[name.replace(".lora_A.", ".lora_B.")].float() @ a.float() * scaling
        deltas[f"{module}.weight"] = delta.t() if adapter_config.get("fan_in_fan_out") else delta
    merged, used = dict(tensors), set()
    for tensor_map in mapping.tensor_maps(config):
        if not any(name in deltas for name in tensor_map.other):
            continue
        shapes = [t.shape for t in tensor_map.from_mega(*(tensors[name] for name in tensor_map.mega))]
        pieces = [deltas.get(name, torch.zeros(shape)) for name, shape in zip(tensor_map.other, shapes, strict=True)]
        for name, delta in zip(tensor_map.mega, tensor_map.to_mega(*pieces), strict=True):
            merged[name] = (tensors[name].float() + delta).to(tensors[name].dtype)
        used.update(tensor_map.other)
    unknown = sorted(set(deltas) - used)
    if unknown:
        raise ValueError(f"the adapter adapts {', '.join(unknown[:3])}, which {mapping.architecture} of this "
                         f"config has no weight for")
    return merged
