"""How each model family's parameters are named in Megatron-LM's files, as one table per family.

mega's canonical names are Megatron-Core's local-spec names (``decoder.layers.3.mlp.linear_fc1.weight``),
so most names pass unchanged. What differs:

* Transformer Engine's spec fuses each norm into the linear layer after it:
  ``self_attention.linear_qkv.layer_norm_weight`` is mega's ``input_layernorm.weight``;
* Megatron-LM's older (non-core) models nest their state dict as ``language_model.encoder.layers.N...``
  with other layer names (``query_key_value``, ``dense_h_to_4h``...);
* torch_dist checkpoints stack a layer dimension in front of every layer tensor, under the key
  without the layer number (``decoder.layers.mlp.linear_fc1.weight``, ``[num_layers, ...]``).

How tensors are split over tensor-parallel ranks is not here: it is mega's own parallel plan
(the ``partition_dim``/``partition_chunks`` marks on each parameter), which follows Megatron's.

* Mixture-of-experts layers hold each expert's tensors on their own in a rank's ``state_dict()``
  (SequentialMLP ``mlp.experts.local_experts.{e}.linear_fc1.weight``, TEGroupedMLP
  ``mlp.experts.linear_fc1.weight{e}``; ``e`` local to the expert-parallel rank), which mega
  stacks as ``mlp.experts.linear_fc1.weight`` ``[experts, ...]``; torch_dist checkpoints stack
  them already, under ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` ``[layers, experts, ...]``.

* An encoder-decoder (T5) has two stacks of layers, ``encoder.layers.N`` and ``decoder.layers.N``,
  each stacked on its own in torch_dist checkpoints; megatron-core's T5 also registers its output
  layer under a second name (``output_layer.*`` beside ``lm_head.output_layer.*``), and so its
  learned position table (``position_embeddings.weight``), which its files hold twice.

* Layers that are not alike (DeepSeek-V3's first dense layers) keep one key per layer in
  torch_dist files (``decoder.layers.N.<name>``), and multi-token-prediction modules always do
  (``mtp.layers.N.eh_proj.weight``, ``mtp.layers.N.transformer_layer.<layer-local name>``).

A family joins by registering its :class:`MegatronNames` (:func:`register`) in a module of this
package that ``__init__`` imports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mega.ckpt_convert.errors import ConversionError

LAYER_PREFIX = "decoder.layers."
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_STACK_LAYER = re.compile(r"((?:en|de)coder\.layers\.)(\d+)\.(.+)")
# A multi-token-prediction module's transformer layer (megatron-core's MultiTokenPredictionBlock):
# named alike in its files and in mega, one key per module (never stacked), on the last stage.
_MTP_LAYER = re.compile(r"(mtp\.layers\.\d+\.transformer_layer\.)(.+)")


@dataclass(frozen=True)
class MegatronNames:
    """One family's names in Megatron files that are not mega's (mega name on the right)."""

    # Layer-local names of Megatron-Core specs other than the local one (Transformer Engine's).
    layer_aliases: dict[str, str] = field(default_factory=dict)
    # Older Megatron-LM models: whole names outside the layers, layer-local prefixes inside them.
    legacy_names: dict[str, str] = field(default_factory=dict)
    legacy_layer_prefix: str | None = "language_model.encoder.layers."  # None: no older names
    legacy_layer_parts: dict[str, str] = field(default_factory=dict)
    # Entries in files that carry no weights mega keeps: tied copies on the last pipeline stage.
    tied_copies: tuple[str, ...] = ()
    # Modules of Megatron-Core's local spec with an ``_extra_state`` entry (None) in their state
    # dict, which Megatron's strict loading expects: layer-local ones, then the others.
    extra_state_layer_modules: tuple[str, ...] = ()
    extra_state_modules: tuple[str, ...] = ()
    # Per-expert names in a rank's state dict: patterns whose groups are (expert, mega's name in
    # ``mlp.experts.``); the SequentialMLP one is what mega writes.
    expert_patterns: tuple[re.Pattern, ...] = ()
    expert_file_name: str = "mlp.experts.local_experts.{expert}.{part}"
    expert_extra_state_parts: tuple[str, ...] = ()
    # The stacks of layers, each stacked on its own in torch_dist files.
    stacks: tuple[str, ...] = (LAYER_PREFIX,)
    # Second names a model registers for one of its tensors: file key -> mega name. Reading skips
    # them; writing repeats the tensor under them, since Megatron's strict loading expects both.
    duplicate_keys: dict[str, str] = field(default_factory=dict)
    # Layer-local names torch_dist files of megatron-core's local spec give mega's (mega name ->
    # file name) where they are not the reverse of ``layer_aliases`` (None: they are). Its
    # multi-latent attention layer maps no norm to a Transformer Engine name, as other layers do.
    written_layer_names: dict[str, str] | None = None
    # Whether mega reads and writes this family's legacy (``--ckpt-format torch``) files too.
    legacy_files: bool = True


_TABLES: dict[str, MegatronNames] = {}  # model family -> its table, filled as the table modules load


def register(names: MegatronNames, *families: str) -> MegatronNames:
    """Make ``names`` the table of ``families`` (each family registers once)."""
    for family in families:
        if family in _TABLES:
            raise ValueError(f"model family {family!r} has a Megatron-LM name table already")
        _TABLES[family] = names
    return names


def names_for(family: str) -> MegatronNames:
    if family not in _TABLES:
        raise ConversionError(f"model family {family!r} has no Megatron-LM name table (mega converts "
                              f"{', '.join(sorted(_TABLES))} checkpoints of Megatron-LM)")
    return _TABLES[family]


def split_layer(name: str) -> tuple[int, str] | None:
    """(layer number, layer-local name) of ``decoder.layers.N.rest``; None for other names."""
    match = _LAYER.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else None


def mega_name(names: MegatronNames, file_name: str, layer_offset: int = 0) -> str:
    """mega's global name of a tensor a Megatron file (a pipeline stage whose first layer is
    ``layer_offset``) names ``file_name``; names it does not know pass unchanged."""
    if file_name in names.legacy_names:
        return names.legacy_names[file_name]
    if names.legacy_layer_prefix and file_name.startswith(names.legacy_layer_prefix):
        number, _, rest = file_name[len(names.legacy_layer_prefix):].partition(".")
        for old, new in names.legacy_layer_parts.items():
            if rest.startswith(old):
                rest = new + rest[len(old):]
                break
        file_name = f"{LAYER_PREFIX}{number}.{rest}"
    layer = split_stack_layer(file_name)
    if layer is None:
        mtp = _MTP_LAYER.fullmatch(file_name)
        return mtp.group(1) + names.layer_aliases.get(mtp.group(2), mtp.group(2)) if mtp else file_name
    stack, number, rest = layer
    offset = layer_offset if len(names.stacks) == 1 else 0  # pipelines renumber a lone stack's layers
    return f"{stack}{number + offset}.{names.layer_aliases.get(rest, rest)}"


def torch_dist_name(names: MegatronNames, name: str) -> str:
    """The name megatron-core's torch_dist files give the mega tensor ``name`` (its layer-local
    part renamed, of a decoder layer or an MTP module's layer; the layer number kept)."""
    layer = split_stack_layer(name)
    head, rest = (layer[0] + f"{layer[1]}.", layer[2]) if layer else (None, None)
    if layer is None and (mtp := _MTP_LAYER.fullmatch(name)):
        head, rest = mtp.groups()
    if head is None:
        return name
    written = names.written_layer_names
    if written is None:
        written = {mega: te for te, mega in names.layer_aliases.items()}
    return head + written.get(rest, rest)


def split_stack_layer(name: str) -> tuple[str, int, str] | None:
    """(stack prefix, layer number, layer-local name) of ``encoder.layers.N.rest`` or
    ``decoder.layers.N.rest``; None for other names."""
    match = _STACK_LAYER.fullmatch(name)
    return (match.group(1), int(match.group(2)), match.group(3)) if match else None


def stack_sizes(names: MegatronNames, mega_names) -> dict[str, int]:
    """Each stack's number of layers among ``mega_names`` (global names of a whole model)."""
    numbers: dict[str, set[int]] = {stack: set() for stack in names.stacks}
    for name in mega_names:
        layer = split_stack_layer(name)
        if layer is not None and layer[0] in numbers:
            numbers[layer[0]].add(layer[1])
    return {stack: len(found) for stack, found in numbers.items() if found}


def expert_of(names: MegatronNames, layer_local: str) -> tuple[str, int] | None:
    """(mega's layer-local name, expert number in the file) of one expert's tensor; None otherwise."""
    for pattern in names.expert_patterns:
        match = pattern.fullmatch(layer_local)
        if match:
            first, second = match.groups()
            expert, part = (first, second) if first.isdigit() else (second, first)
            return f"mlp.experts.{part}", int(expert)
    return None


def stacked_expert(names: MegatronNames, name: str, expert_rank: int, local_experts: int) -> tuple[str, int] | None:
    """(mega's stacked name, global expert) of one expert's tensor of expert-parallel rank
    ``expert_rank`` (files number their own experts from 0), mega-named ``name``; None for others."""
    layer = split_layer(name)
    expert = expert_of(names, layer[1]) if layer is not None else None
    if expert is None:
        return None
    return f"{LAYER_PREFIX}{layer[0]}.{expert[0]}", expert_rank * local_experts + expert[1]


def expert_of_file_key(names: MegatronNames, key: str) -> tuple[str, int] | None:
    """(mega's layer-local stacked name, expert number) of one expert's tensor in a rank file's model
    state dict (``key``, perhaps behind a model chunk's name); None for the others."""
    layer = split_stack_layer(key) or split_stack_layer(key.partition(".")[2])
    return expert_of(names, layer[2]) if layer is not None else None
