"""Writing any :class:`~mega.ckpt_convert.source.ModelSource` as a Hugging Face model directory:
config.json, safetensors weights (sharded with an index when large) and tokenizer files, laid
out so ``AutoModelForCausalLM`` and ``AutoTokenizer`` load it. Needs no ``transformers``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.hf_tokenizer import write_hf_tokenizer
from mega.ckpt_convert.hf_weights import write_hf_weights
from mega.ckpt_convert.progress import Progress
from mega.ckpt_convert.safetensors_io import TensorToWrite
from mega.ckpt_convert.source import ModelSource, format_names
from mega.ckpt_convert.tensor_maps import LastConverted, converted_shapes
from mega.core.model_family import HFMapping, TensorMap

# The token ids config.json repeats from generation_config.json.
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def write_hf(source: ModelSource, mapping: HFMapping, directory: Path, max_shard_bytes: int,
             progress: bool | None, with_initialised_heads: bool = False) -> list[str]:
    """``source`` as a Hugging Face directory. A source converted from one (its ``origin``) goes
    back as it came: its architecture, its tensor names (a base model's without the prefix), its
    copies and buffers, and without the heads mega initialised (unless ``with_initialised_heads``)."""
    config = source.config
    try:
        config_json = mapping.config_to_hf(config)
    except ValueError as error:
        raise ConversionError(f"the {source.family} model cannot be written for transformers: {error}") from None
    maps = mapping.tensor_maps(config)
    tensors = _tensors_to_write(source, maps)
    origin = getattr(source, "origin", None)
    if origin and origin.get("format") == "hf" and not with_initialised_heads:
        if origin["architecture"] in (mapping.architecture, *mapping.also_reads):  # not where training changed the class
            config_json["architectures"] = [origin["architecture"]]
        tensors = _as_it_came(tensors, origin, mapping, config)

    def convert(tensor_map: TensorMap):
        inputs = (source.get(name)[: config.vocab_size] if tensor_map.vocab else source.get(name)
                  for name in tensor_map.mega)
        return [tensor.contiguous() for tensor in tensor_map.from_mega(*inputs)]

    converted = LastConverted(convert)
    writes = [TensorToWrite(name, shape, dtype, lambda m=tensor_map, i=index: converted.output(m, i))
              if tensor_map is not None else TensorToWrite(name, shape, dtype, lambda t=index: t)
              for name, shape, dtype, tensor_map, index in tensors]
    meter = Progress(sum(t.nbytes for t in writes), config.num_layers, progress)
    try:
        write_hf_weights(directory, writes, max_shard_bytes, on_written=lambda t: meter.advance(t.name, t.nbytes))
    finally:
        meter.close()
    floating = [t.dtype for t in writes if t.dtype.is_floating_point]
    config_json["dtype"] = str(max(set(floating), key=floating.count)).removeprefix("torch.") if floating else "float32"
    config_json.update(_token_ids(source))
    (directory / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    warning = write_hf_tokenizer(source.tokenizer, source.tokenizer_extras, directory)
    return [warning] if warning else []


def _tensors_to_write(source: ModelSource, maps: list[TensorMap]) -> list[tuple]:
    """(Hugging Face name, shape, dtype, map, output index) of every output tensor, in map order,
    after checking the source holds exactly the tensors the maps take, at shapes they take."""
    vocab_size = source.config.vocab_size
    wanted = [name for tensor_map in maps for name in tensor_map.mega]
    missing, unexpected = set(wanted) - set(source.names()), set(source.names()) - set(wanted)
    if missing:
        raise ConversionError(f"the {source.family} checkpoint lacks {format_names(missing)}")
    if unexpected:
        raise ConversionError(f"the {source.family} checkpoint holds {format_names(unexpected)}, which the "
                              "Hugging Face model has no place for")
    tensors = []
    for tensor_map in maps:
        shapes = []
        for name in tensor_map.mega:
            shape = source.shape(name)
            if tensor_map.vocab:
                if shape[0] < vocab_size:
                    raise ConversionError(f"{name} has {shape[0]} vocabulary rows, fewer than the config's "
                                          f"vocab_size {vocab_size}")
                shape = (vocab_size, *shape[1:])
            shapes.append(shape)
        try:
            out_shapes = converted_shapes(tensor_map.from_mega, shapes)
        except RuntimeError as error:
            raise ConversionError(f"{format_names(tensor_map.mega)} with shapes {shapes} do not fit the model "
                                  f"config: {error}") from None
        dtype = source.dtype(tensor_map.mega[0])
        tensors += [(name, shape, dtype, tensor_map, index)
                    for index, (name, shape) in enumerate(zip(tensor_map.other, out_shapes, strict=True))]
    return tensors


def _as_it_came(tensors: list[tuple], origin: dict, mapping: HFMapping, config) -> list[tuple]:
    """``tensors`` (as :func:`_tensors_to_write` lists them) as the source directory held them:
    without the heads initialised on import, with its copies and buffers, and without the base
    model's prefix where a base model (``BertModel``) came in. A buffer is (name, shape, dtype,
    None, its tensor)."""
    initialised = set(origin.get("initialised", ()))
    kept = [entry for entry in tensors if entry[0] not in initialised]
    by_name = {entry[0]: entry for entry in kept}
    copies = mapping.copies(config) if mapping.copies else {}
    for name in origin.get("copies", ()):
        if copies.get(name) in by_name:
            kept.append((name, *by_name[copies[name]][1:]))
    buffers = mapping.buffers(config) if mapping.buffers else {}
    for name, dtype in origin.get("buffers", {}).items():
        if name in buffers:
            tensor = buffers[name].to(getattr(torch, dtype)).contiguous()
            kept.append((name, tuple(tensor.shape), tensor.dtype, None, tensor))
    prefix = mapping.base_model_prefix
    if origin.get("base_model_only") and origin.get("architecture") != mapping.architecture and \
            all(entry[0].startswith(prefix) for entry in kept):
        kept = [(entry[0].removeprefix(prefix), *entry[1:]) for entry in kept]
    return kept


def _token_ids(source: ModelSource) -> dict:
    """bos/eos/pad ids from generation_config.json when one came along; else unknown (null), never
    transformers' per-model defaults, which need not exist in this vocabulary."""
    ids = dict.fromkeys(TOKEN_ID_KEYS)
    path = source.tokenizer_extras.get("generation_config.json")
    if path is not None:
        try:
            generation = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ConversionError(f"{path} is not valid JSON ({error})") from None
        ids.update({key: generation[key] for key in TOKEN_ID_KEYS if key in generation})
    return ids
