"""A LoRA run's adapters merged into a built model at load: ``mega generate/serve/eval --adapter DIR``.

The model is built and its base weights loaded as usual (at any tensor-parallel size); then the
adapter checkpoint's layers are wrapped by :func:`~mega.models.lora.adapters.apply_lora` (so A and B are
split as their layers are), only the adapter tensors are read from the checkpoint (each rank its
pieces), and :func:`~mega.models.lora.adapters.merge_lora` folds them in: what is served is the plain model
``mega lora merge`` would have written, with no adapter left in the forward pass.

The adapters' shape says the LoRA settings (rank from A's rows, the targets from the layer names,
alpha / rank from the saved ``scaling``). A checkpoint that is no LoRA run's, or whose adapters do
not fit this base (another family, other layers or sizes), is an error naming the tensor.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from mega.core.checkpoint import CheckpointError, checkpoint_and_metadata
from mega.core.checkpoint.sharded_io import load_entries, read_index
from mega.core.checkpoint.state import BUFFER, MODEL, Entries, model_entries
from mega.core.checkpoint.validate import check_entries
from mega.models.lora.adapters import TARGETS, LoRAAdapter, LoRAError, LoRASettings, apply_lora, merge_lora

ADAPTER = ".adapter."
LINEAR_IN = ".adapter.linear_in.weight"


def merge_adapter_at_load(model: nn.Module, path: str | Path, family_name: str, groups=None,
                          flag: str = "--adapter") -> int:
    """Fold the adapters of the LoRA checkpoint ``path`` into ``model`` (built for ``family_name``,
    its base weights loaded, tensor-parallel over ``groups.tp``); returns how many layers."""
    if (Path(path) / "adapter_config.json").is_file():
        raise LoRAError(f"{flag} {path} is a PEFT adapter directory: fold it into a mega checkpoint first "
                        f"(mega convert --from hf-peft --input {path} --base BASE --output DIR) and load that")
    try:
        directory, metadata = checkpoint_and_metadata(path)
    except CheckpointError as error:
        raise LoRAError(f"{flag}: {error}") from None
    if metadata.model_family != family_name:
        raise LoRAError(f"{flag} {path}: its adapters were trained on a {metadata.model_family} model, this base "
                        f"is {family_name}")
    index = read_index(directory)
    in_weights = sorted(key[len(MODEL):] for key in index if key.startswith(MODEL) and key.endswith(LINEAR_IN))
    if not in_weights:
        raise LoRAError(f"{flag} {path} holds no LoRA adapters (a checkpoint of a mega train --lora-rank run)")
    ranks = {index[MODEL + name].size[0] for name in in_weights}
    targets = {name[: -len(LINEAR_IN)].rpartition(".")[2] for name in in_weights}
    if len(ranks) != 1 or not targets <= set(TARGETS):
        raise LoRAError(f"{flag} {path}: adapters of ranks {sorted(ranks)} on {', '.join(sorted(targets))}: "
                        f"not one LoRA run's (one rank, on {', '.join(TARGETS)})")
    # alpha: any value (the saved scaling, loaded below, is what the merge multiplies by)
    apply_lora(model, LoRASettings(rank=ranks.pop(), alpha=1.0, targets=tuple(sorted(targets))), seed=0)
    for module in model.modules():
        if isinstance(module, LoRAAdapter):
            module.float()  # read exactly as saved; the merge casts to the base's dtype once
    tp = groups.tp if groups is not None else None
    everything = model_entries([model], tp)
    wanted = Entries(entries={key: entry for key, entry in everything.entries.items()
                              if ADAPTER in key and key.startswith((MODEL, BUFFER))},
                     sources={key: source for key, source in everything.sources.items() if ADAPTER in key})
    extra = sorted(key for key in index if ADAPTER in key and key.startswith(MODEL) and key not in wanted.entries)
    try:
        if extra:
            raise CheckpointError(f"{path} adapts {extra[0][len(MODEL):]}, which this base model does not have")
        check_entries(directory, wanted, index)
    except CheckpointError as error:
        raise LoRAError(f"{flag}: the adapters do not fit this base model: {error}") from None
    load_entries(directory, wanted.entries, alone=True)
    return merge_lora(model)
