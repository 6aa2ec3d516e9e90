"""Hugging Face PEFT's LoRA adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``):
reading one (:func:`read_peft_adapter`, which ``mega convert --from hf-peft`` folds into weights), and
carrying its A and B to mega's layers as they are, for serving beside the base
(:func:`peft_adapter_weights`).

PEFT adapts each Hugging Face module apart (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``,
``up_proj``) where mega's layer fuses them. The fused layer's adapter is exact at the sum of their
ranks: A is the modules' A stacked (``[r_q + r_k + r_v, in]``), B is block-diagonal (each module's B
in its own columns, zeros elsewhere), its rows rearranged by the family's tensor map as the fused
weight's rows are. A module the adapter leaves alone gets zero rows of B.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from mega.models.lora.adapters import LoRAError
from mega.models.lora.multi import AdapterWeights

PEFT_PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"


def is_peft_adapter(directory: str | os.PathLike) -> bool:
    return (Path(directory) / CONFIG_FILE).is_file()


def read_peft_adapter(directory: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(adapter_config, tensors)`` of a PEFT LoRA directory, checked to be what mega can use."""
    # optional dependency: safetensors (the [test] extra, or with peft) reads PEFT's files
    from safetensors.torch import load_file

    directory = Path(directory)
    try:
        adapter_config = json.loads((directory / CONFIG_FILE).read_text())
        tensors = load_file(str(directory / "adapter_model.safetensors"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{directory}: not a PEFT adapter directory ({error})") from None
    if adapter_config.get("peft_type") != "LORA":
        raise ValueError(f"{directory}: adapter_config.json's peft_type is {adapter_config.get('peft_type')!r}, not LORA")
    for field in ("rank_pattern", "alpha_pattern"):
        if adapter_config.get(field):
            raise ValueError(f"{directory}: adapter_config.json's {field} (per-module ranks) is not supported")
    extra = [name for name in tensors if ".lora_A." not in name and ".lora_B." not in name]
    if extra:
        raise ValueError(f"{directory}: holds {', '.join(sorted(extra)[:3])}, which is not a LoRA A or B of a "
                         f"linear layer (bias='none' adapters only)")
    return adapter_config, tensors


def peft_scaling(adapter_config: Mapping) -> float:
    """alpha / r, or alpha / sqrt(r) with rsLoRA."""
    rank, alpha = adapter_config["r"], adapter_config["lora_alpha"]
    return alpha / math.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank


def peft_adapter_weights(mapping, config, adapter_config: Mapping, peft: Mapping[str, torch.Tensor],
                         weight_shapes: Mapping[str, torch.Size]) -> AdapterWeights:
    """A PEFT adapter's A and B on mega's layers (``weight_shapes``: each adaptable layer's
    global weight name and shape), the scaling folded into B."""
    scaling, transposed = peft_scaling(adapter_config), bool(adapter_config.get("fan_in_fan_out"))
    modules = {}  # Hugging Face weight name -> (A [r, in], B [out, r] * scaling)
    for name, a in peft.items():
        if ".lora_A." in name:
            module = name.removeprefix(PEFT_PREFIX).rsplit(".lora_A.", 1)[0]
            modules[f"{module}.weight"] = (a.float(), peft[name.replace(".lora_A.", ".lora_B.")].float() * scaling)
    layers, used = {}, set()
    for tensor_map in mapping.tensor_maps(config):
        adapted = [name for name in tensor_map.other if name in modules]
        if not adapted:
            continue
        mega_name = tensor_map.mega[0]
        if len(tensor_map.mega) != 1 or mega_name not in weight_shapes:
            raise LoRAError(f"it adapts {adapted[0]}, whose weight {mega_name} LoRA cannot adapt in mega")
        shapes = [piece.shape for piece in tensor_map.from_mega(torch.empty(weight_shapes[mega_name], device="meta"))]
        rank = sum(modules[name][0].shape[0] for name in adapted)
        pieces, column = [], 0
        for name, shape in zip(tensor_map.other, shapes, strict=True):
            out = shape[1] if transposed else shape[0]
            piece = torch.zeros(out, rank)
            if name in modules:
                b = modules[name][1]
                piece[:, column: column + b.shape[1]] = b
                column += b.shape[1]
            pieces.append(piece.t() if transposed else piece)
        [b] = tensor_map.to_mega(*pieces)
        if tuple(b.shape) != (weight_shapes[mega_name][0], rank):
            raise LoRAError(f"{mega_name}: the adapter's B comes out {tuple(b.shape)}, not [{weight_shapes[mega_name][0]}, "
                            f"{rank}]")
        a = torch.cat([modules[name][0] for name in adapted])
        layers[mega_name.removesuffix(".weight")] = (a, b.contiguous())
        used.update(adapted)
    unknown = sorted(set(modules) - used)
    if unknown:
        raise LoRAError(f"it adapts {', '.join(unknown[:3])}, which {mapping.architecture} of this config has no "
                        "weight for")
    return AdapterWeights(layers)
