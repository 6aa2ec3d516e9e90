"""An adapter directory read for serving beside its base (:mod:`~mega.models.lora.multi`): a LoRA
run's mega checkpoint (``mega train --lora-rank ... --save DIR``) or a PEFT adapter directory
(:mod:`~mega.models.lora.peft`), as :class:`~mega.models.lora.multi.AdapterWeights` (global
tensors, the scaling folded into B).

A mega adapter checkpoint records its base (``adapter.base`` of its metadata: path and weights
fingerprint, :mod:`mega.core.checkpoint.adapter_record`); an adapter whose recorded fingerprint is
not the served base's is refused naming both, as is one of another model family.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mega.core.checkpoint import CheckpointError, checkpoint_and_metadata
from mega.core.checkpoint.sharded_io import ShardedEntry, load_entries, read_index
from mega.core.parallel.pieces import Piece
from mega.models.lora.adapters import LoRAError
from mega.models.lora.multi import AdapterWeights
from mega.models.lora.peft import is_peft_adapter, peft_adapter_weights, read_peft_adapter

MODEL, BUFFER = "model.", "buffer."
LINEAR_IN, LINEAR_OUT, SCALING = ".adapter.linear_in.weight", ".adapter.linear_out.weight", ".adapter.scaling"


def read_adapter(path: str | Path, family, config, weight_shapes, base_fingerprint: str | None,
                 base_label: str) -> AdapterWeights:
    """The adapter at ``path`` for the served base (a ``family`` model of ``config``, its adaptable
    layers' global weight shapes ``weight_shapes``, its weights' fingerprint ``base_fingerprint``
    where it is a mega checkpoint, named ``base_label`` in errors)."""
    if is_peft_adapter(path):
        try:
            adapter_config, tensors = read_peft_adapter(path)
        except ValueError as error:
            raise LoRAError(str(error)) from None
        if family.hf_mapping is None:
            raise LoRAError(f"{path} is a PEFT adapter, and the {family.name} family has no Hugging Face mapping")
        return peft_adapter_weights(family.hf_mapping, config, adapter_config, tensors, weight_shapes)
    try:
        directory, metadata = checkpoint_and_metadata(path)
    except CheckpointError as error:
        raise LoRAError(f"{path}: neither a PEFT adapter directory (adapter_config.json) nor a mega checkpoint "
                        f"({error})") from None
    if metadata.model_family != family.name:
        raise LoRAError(f"{path}: its adapters were trained on a {metadata.model_family} model, the served base "
                        f"{base_label} is {family.name}")
    recorded = (metadata.adapter or {}).get("base") or {}
    if recorded.get("fingerprint") and base_fingerprint and recorded["fingerprint"] != base_fingerprint:
        raise LoRAError(f"{path} was trained on {recorded.get('path')} (weights {recorded['fingerprint']}), not on "
                        f"the served base {base_label} (weights {base_fingerprint}): other weights, or the same "
                        "saved at another layout")
    return AdapterWeights(_mega_adapter_layers(directory, path))


def _mega_adapter_layers(directory: Path, path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer: (A, B * scaling)}`` read whole from a mega checkpoint's adapter tensors."""
    index = read_index(directory)
    layers = [key[len(MODEL): -len(LINEAR_IN)] for key in index if key.startswith(MODEL) and key.endswith(LINEAR_IN)]
    if not layers:
        raise LoRAError(f"{path} holds no LoRA adapters (a checkpoint of a mega train --lora-rank run)")
    keys = [key for layer in layers for key in (MODEL + layer + LINEAR_IN, MODEL + layer + LINEAR_OUT,
                                                BUFFER + layer + SCALING)]
    if missing := [key for key in keys if key not in index]:
        raise LoRAError(f"{path} lacks {missing[0]} beside its other adapter tensors")
    tensors = {key: torch.empty(tuple(index[key].size), dtype=index[key].properties.dtype) for key in keys}
    load_entries(directory, {key: ShardedEntry(tuple(t.shape), t.dtype, [Piece(t, (0,) * t.dim())])
                             for key, t in tensors.items()}, alone=True)
    return {layer: (tensors[MODEL + layer + LINEAR_IN].float(),
                    tensors[MODEL + layer + LINEAR_OUT].float() * float(tensors[BUFFER + layer + SCALING]))
            for layer in layers}
