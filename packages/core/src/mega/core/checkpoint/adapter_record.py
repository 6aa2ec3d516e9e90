"""What a checkpoint of adapters alone (a LoRA run's) records of them (``CheckpointMetadata.adapter``),
and finding the base it names. No torch: ``mega checkpoint info`` reads it.

The record holds the adapters' settings, as the modules that hold them declare them (an
``adapter_settings`` dict: LoRA's method, rank, alpha, dropout and targets), how many parameters
they train, and their base: the path of the checkpoint the run loaded its weights from, its
iteration and :func:`weights_fingerprint`, so ``--load ADAPTER_DIR`` alone can find the base and
tell whether it is still the one the adapters were trained on.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from pathlib import Path

from mega.core.checkpoint.directory import checkpoint_and_metadata
from mega.core.checkpoint.metadata import DCP_METADATA_FILE, CheckpointError, CheckpointMetadata

MODEL = "model."  # the model tensors' prefix (mega.core.checkpoint.state.MODEL, which imports torch)

ADAPTER = ".adapter."  # in every adapter tensor's name
TENSOR_FILE_SUFFIX = ".distcp"  # torch.distributed.checkpoint's data files


def weights_fingerprint(metadata: CheckpointMetadata) -> str | None:
    """``sha256:...`` over the checksums of a checkpoint's tensor files (its data files and their
    index, recorded at its save: nothing is read), or None for one saved before checksums were.
    The same weights saved at another layout have another fingerprint."""
    tensors = {name: checksum for name, checksum in metadata.checksums.items()
               if name.endswith(TENSOR_FILE_SUFFIX) or name == DCP_METADATA_FILE}
    if not tensors:
        return None
    return "sha256:" + hashlib.sha256(json.dumps(tensors, sort_keys=True).encode()).hexdigest()


def base_record(path: Path, metadata: CheckpointMetadata | None) -> dict:
    """What an adapter checkpoint records of the base it was trained on (``metadata`` None: a
    checkpoint of another format, which has no fingerprint)."""
    return {"path": str(Path(path).resolve()), "iteration": None if metadata is None else metadata.iteration,
            "fingerprint": None if metadata is None else weights_fingerprint(metadata)}


def adapter_record(modules: Iterable, tensors: dict[str, list[int]] | None, base: dict | None) -> dict | None:
    """``CheckpointMetadata.adapter`` of a model whose ``modules`` include adapters that declare
    ``adapter_settings`` (the first one's, their targets together), else None; ``tensors`` (every
    tensor the save writes, over all ranks) gives the trainable parameters."""
    settings, targets = None, []
    for module in modules:
        declared = getattr(module, "adapter_settings", None)
        if isinstance(declared, dict):
            settings = settings or dict(declared)
            targets += declared.get("targets", [])
    if settings is None:
        return None
    trainable = sum(math.prod(shape) for name, shape in (tensors or {}).items()
                    if name.startswith(MODEL) and ADAPTER in name)
    return {**settings, "targets": sorted(set(targets)), "trainable_parameters": trainable, "base": base}


def locate_base(adapter: dict) -> tuple[Path | None, str]:
    """The base checkpoint an adapter record names, when it is there with the weights the adapters
    were trained on; else None and why not (a sentence that starts with the base's path)."""
    base = adapter.get("base") or {}
    path = base.get("path")
    if not path:
        return None, "no base is recorded"
    if not Path(path).exists():
        return None, f"{path} is not there"
    try:
        directory, metadata = checkpoint_and_metadata(path, checksums=False)
    except CheckpointError as error:
        return None, f"{path} cannot be read ({error})"
    expected = base.get("fingerprint")
    if expected and weights_fingerprint(metadata) != expected:
        return None, f"{path} holds other weights than the adapters were trained on (fingerprint {expected})"
    return directory, f"{path} (found, its weights unchanged)" if expected else f"{path} (found)"
