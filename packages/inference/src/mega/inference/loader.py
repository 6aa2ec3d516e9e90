"""Loading the model to generate with: a mega checkpoint, or a Hugging Face directory.

``--load PATH`` holding a ``config.json`` is a Hugging Face model, read through the checkpoint
format registered as ``hf`` (mega-ckpt-convert's plugin); anything else is a mega checkpoint (a
save directory following its tracker, or one checkpoint directory), read through the core. Either
way the model is built at this process's tensor-parallel size (the tensor group is the whole
world under torchrun) and the weights are resharded from whatever layout they were saved at.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mega.core.build import build_stage
from mega.core.checkpoint import CheckpointError, checkpoint_and_metadata, load_model_weights
from mega.core.checkpoint import tokenizer_spec as saved_tokenizer
from mega.core.checkpoint.adapter_record import locate_base, weights_fingerprint
from mega.core.checkpoint.directory import RELEASE
from mega.core.parallel import ParallelGroups
from mega.core.plugins import PluginError, get_plugins
from mega.core.process_group import distributed_env
from mega.core.tokenizer import TokenizerOptions, TokenizerSpec
from mega.inference.chat_template import find_chat_template
from mega.inference.dtypes import DTYPE_NAMES
from mega.inference.quantization import (
    QuantizationError,
    QuantizationRequest,
    WeightBytes,
    quantization_pass,
    quantize,
)

HF_FORMAT = "hf"  # the registered checkpoint format that reads Hugging Face directories
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


class LoadError(RuntimeError):
    """The model or tokenizer cannot be loaded; the message says what is missing."""


@dataclass
class LoadedModel:
    model: nn.Module
    family_name: str
    config: Any
    tokenizer: Any  # mega.core.tokenizer.Tokenizer, or None when nothing says which
    name: str  # what the OpenAI API reports as the model
    chat_template: Any = None  # mega.inference.chat_template.ChatTemplate, when the tokenizer carries one
    base_name: str | None = None  # with an adapter merged in: the base model's name (``name`` is the adapter's)
    quantized: WeightBytes | None = None  # with --quantization: this rank's weight bytes before and after

    @property
    def max_positions(self) -> int:
        return getattr(self.config, "max_position_embeddings", None) or self.config.seq_length


def default_device() -> torch.device:
    if torch.cuda.is_available():
        env = distributed_env()
        return torch.device("cuda", env["local_rank"] if env else torch.cuda.current_device())
    return torch.device("cpu")


def load_from_args(args: argparse.Namespace, groups: ParallelGroups, plugins=None) -> LoadedModel:
    """The model ``--load`` (and ``--adapter``, merged) names, with ``--quantization``'s pass run
    over it last: a kind the device cannot run is refused before any weight is read."""
    plugins = get_plugins() if plugins is None else plugins
    tokenizer_spec = None
    if args.tokenizer_type:
        tokenizer_spec = TokenizerSpec(args.tokenizer_type, TokenizerOptions(
            vocab_file=args.vocab_file, merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
            vocab_size=args.vocab_size))
    device = torch.device(args.device) if args.device else default_device()
    kind = getattr(args, "quantization", None)
    request = QuantizationRequest(kind, device, DTYPES[args.dtype]) if kind else None
    try:
        setup_pass = quantization_pass(request, plugins) if request else None
    except QuantizationError as error:
        raise LoadError(str(error)) from None
    base, adapter = base_and_adapter(args.load, getattr(args, "adapter", None))
    loaded = load_model(base, groups=groups, device=device, dtype=DTYPES[args.dtype],
                        tokenizer_spec=tokenizer_spec, plugins=plugins)
    if adapter is not None:
        # start-up cost: the LoRA code is imported only when an adapter is served
        from mega.models.lora.adapters import LoRAError
        from mega.models.lora.load import merge_adapter_at_load

        try:
            merge_adapter_at_load(loaded.model, adapter, loaded.family_name, groups)
        except LoRAError as error:
            raise LoadError(str(error)) from None
        loaded.base_name, loaded.name = loaded.name, checkpoint_name(adapter)
    if setup_pass is not None:
        try:
            loaded.model, loaded.quantized = quantize(loaded.model, setup_pass, request,
                                                      plugins.models.get(loaded.family_name), loaded.config, groups)
        except QuantizationError as error:
            raise LoadError(str(error)) from None
    return loaded


def base_and_adapter(load: str, adapter: str | None) -> tuple[str, str | None]:
    """``--load`` and ``--adapter`` as given, or, for ``--load`` of adapters alone (a LoRA run's
    checkpoint), the base its metadata records and the adapters: an error when that base is
    gone or holds other weights, naming ``--load BASE --adapter DIR``."""
    if adapter is not None:
        _note_another_base(load, adapter)
        return load, adapter
    if (Path(load) / "config.json").is_file():
        return load, None
    try:
        _, metadata = checkpoint_and_metadata(load, checksums=False)
    except CheckpointError:
        return load, None  # not a mega checkpoint: load_model says what it is
    names = [name for name in metadata.tensors or {} if name.startswith("model.")]
    if metadata.adapter is None and not (names and all(".adapter." in name for name in names)):
        return load, None
    base, why = locate_base(metadata.adapter or {})
    if base is None:
        raise LoadError(f"--load {load} holds LoRA adapters alone, and their base cannot be used: {why}; give the "
                        f"base model with --load BASE --adapter {load}")
    return str(base), load


def _note_another_base(load: str, adapter: str) -> None:
    """Say so when ``--load`` is a mega checkpoint whose weights fingerprint is not the one the
    adapters record of their base (other weights, or the same saved at another layout)."""
    try:
        recorded = (checkpoint_and_metadata(adapter, checksums=False)[1].adapter or {}).get("base") or {}
        _, base = checkpoint_and_metadata(load, checksums=False)
    except CheckpointError:
        return  # not mega checkpoints: loading says what they are
    if recorded.get("fingerprint") and weights_fingerprint(base) != recorded["fingerprint"]:
        print(f"note: --adapter {adapter} was trained on {recorded.get('path')}; --load {load} has other tensor "
              "files (other weights, or the same saved at another layout)", file=sys.stderr)


def checkpoint_name(path: str | Path) -> str:
    """A checkpoint's name as served: its save directory's for one iteration's directory."""
    path = Path(path).resolve()
    return path.parent.name if path.name == RELEASE or path.name.startswith("iter_") else path.name


def load_model(path: str | Path, *, groups: ParallelGroups, device: torch.device, dtype: torch.dtype = torch.float32,
               tokenizer_spec: TokenizerSpec | None = None, plugins=None) -> LoadedModel:
    """Build the checkpoint's model family at ``groups``' tensor-parallel size and fill it;
    ``tokenizer_spec`` replaces the tokenizer the checkpoint names."""
    plugins = get_plugins() if plugins is None else plugins
    path = Path(path)
    if not path.exists():
        raise LoadError(f"--load {path}: no such file or directory")
    if (path / "config.json").is_file():
        source = _open_hugging_face(path, plugins)
        try:
            family_name, config = source.family, source.config
            spec = tokenizer_spec or source.tokenizer
            tokenizer = build_tokenizer(spec, plugins)
            model = build_model(plugins.models.get(family_name), config, groups, device, dtype)
            load_model_weights(source, [model], groups)
        finally:
            source.close()
    else:
        checkpoint, metadata = checkpoint_and_metadata(path)
        family_name = metadata.model_family
        config = plugins.models.get(family_name).config_class(**metadata.model_config)
        spec = tokenizer_spec or saved_tokenizer(checkpoint, metadata)
        tokenizer = build_tokenizer(spec, plugins)
        model = build_model(plugins.models.get(family_name), config, groups, device, dtype)
        load_model_weights(checkpoint, [model], groups)
    return LoadedModel(model=model, family_name=family_name, config=config, tokenizer=tokenizer,
                       name=checkpoint_name(path), chat_template=find_chat_template(spec))


def _open_hugging_face(path: Path, plugins):
    """A model source over a Hugging Face directory, from the checkpoint format registered as
    ``hf`` (mega-ckpt-convert's), found through the plugins as the design has it."""
    try:
        checkpoint_format = plugins.checkpoint_formats.get(HF_FORMAT)
    except PluginError as error:
        raise LoadError(f"--load {path} is a Hugging Face directory, which needs the {HF_FORMAT!r} checkpoint "
                        f"format (pip install -c constraints.txt -e packages/ckpt-convert, from the mega repository): {error}") from None
    return checkpoint_format.open(path)


def build_model(family, config, groups: ParallelGroups, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The whole model (one stage), tensor-parallel over ``groups.tp``, in eval mode, its shards
    allocated but not initialised: the weights are loaded next."""
    return build_stage(family, config, groups=groups, device=device, dtype=dtype, init=False, training=False).eval()


def build_tokenizer(spec: TokenizerSpec | None, plugins):
    return spec.build(plugins) if spec else None
