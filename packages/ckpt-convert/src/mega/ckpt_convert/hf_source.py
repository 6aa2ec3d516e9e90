"""A Hugging Face model directory as a :class:`~mega.ckpt_convert.source.ModelSource`.

Opening checks everything before a tensor is read: config.json names an architecture a family
maps, every tensor the config implies is in the files at the shape it implies, and nothing else
is (the config and the weights describe the same model). Tensors are then read and converted
one map at a time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.hf_tokenizer import read_hf_tokenizer
from mega.ckpt_convert.hf_weights import HFWeights
from mega.ckpt_convert.mxfp4 import dequantizing
from mega.ckpt_convert.source import ClosingSource, format_names, model_parameters
from mega.ckpt_convert.tensor_maps import LastConverted, converted_shapes
from mega.core.build import DEFAULT_SEED, parameter_generator
from mega.core.model_family import ModelFamily, TensorMap

CONFIG_FILE = "config.json"


def read_config_json(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise ConversionError(f"{directory} is not a Hugging Face model directory: {CONFIG_FILE} is missing")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConversionError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path} must hold a JSON object")
    return config


def find_family(config_json: dict, config_path: Path, model_family: str | None, plugins) -> ModelFamily:
    """The family whose Hugging Face mapping is config.json's architecture (``--model-family``
    when given, which must then agree)."""
    architectures = config_json.get("architectures") or []
    model_type = config_json.get("model_type")

    def matches(family: ModelFamily) -> bool:
        mapping = family.hf_mapping
        read = (mapping.architecture, *mapping.also_reads)
        return any(name in architectures for name in read) or (not architectures and model_type == mapping.model_type)

    if model_family is not None:
        family = plugins.models.get(model_family)
        if family.hf_mapping is None:
            raise ConversionError(f"model family {model_family!r} has no Hugging Face counterpart")
        if (architectures or model_type) and not matches(family):
            raise ConversionError(f"{config_path} describes {architectures or model_type}, but --model-family "
                                  f"{model_family} is {family.hf_mapping.architecture}")
        return family
    supported = []
    for name in plugins.models.names():
        family = plugins.models.get(name)
        if family.hf_mapping is not None:
            if matches(family):
                return family
            supported.append(f"{family.hf_mapping.architecture} ({name})")
    found = architectures or model_type
    if not found:
        raise ConversionError(f"{config_path} has neither architectures nor model_type; name the family "
                              "with --model-family")
    raise ConversionError(f"{config_path}: unsupported architecture {found}; mega converts "
                          f"{', '.join(supported) or 'none (no model family with a Hugging Face mapping is installed)'}")


class HFSource(ClosingSource):
    def __init__(self, directory: Path, family: ModelFamily, config_json: dict, allow_unused: bool = False):
        self.directory, self.allow_unused = directory, allow_unused
        self.family = family.name
        mapping = family.hf_mapping
        try:
            self.config = mapping.config_from_hf(config_json)
        except (ValueError, TypeError) as error:
            raise ConversionError(f"{directory / CONFIG_FILE}: {error}") from None
        self.tokenizer, self.tokenizer_extras = read_hf_tokenizer(directory)
        self._maps = mapping.tensor_maps(self.config)
        self._by_name = {name: (tensor_map, i) for tensor_map in self._maps for i, name in enumerate(tensor_map.mega)}
        self._weights, dequantized = dequantizing(HFWeights(directory), config_json)
        self._converted = LastConverted(self._convert)
        self._family = family
        # What the user should know (heads initialised here, quantized experts dequantized).
        self.warnings: list[str] = [dequantized] if dequantized else []
        try:
            self._stored = self._stored_names(mapping.base_model_prefix)
            self._absent = self._absent_maps(mapping.optional)
            self._shapes = self._check(family, mapping.ignored)
        except BaseException:
            self._weights.close()
            raise
        # What came in, so that an export gives it back (mega_format keeps it in the checkpoint).
        self.origin = {
            "format": "hf", "architecture": (config_json.get("architectures") or [mapping.architecture])[0],
            "base_model_only": any(name != stored for name, stored in self._stored.items()),
            "initialised": sorted(name for tensor_map in self._absent for name in tensor_map.other),
            "copies": sorted(self._copies), "buffers": self._buffers,
        }

    def _stored_names(self, prefix: str) -> dict[str, str]:
        """Mapped name -> name in the files: a checkpoint of the base model alone (GPT-2 on the
        Hub: ``h.0.attn...``) lacks the prefix the full model's names have (``transformer.``)."""
        names = self._weights.names()
        if names and not any(name.startswith(prefix) for name in names):
            return {prefix + name: name for name in names}
        return {name: name for name in names}

    def _check(self, family: ModelFamily, ignored: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
        """Mega name -> shape, after checking the files hold exactly the model config.json describes."""
        config_path = self.directory / CONFIG_FILE
        wanted = {name for tensor_map in self._maps if tensor_map not in self._absent for name in tensor_map.other}
        missing = wanted - set(self._stored)
        if missing:
            raise ConversionError(f"{self.directory} lacks {format_names(missing)}, which {config_path} implies "
                                  f"({self.config.num_layers} layers); the weights and the config disagree")
        self._extra_tensors(set(self._stored) - wanted, ignored)
        parameters = model_parameters(family, self.config)
        if set(self._by_name) != set(parameters):
            raise ConversionError(f"the {family.name} family's Hugging Face mapping does not cover its model: "
                                  f"{format_names(set(self._by_name) ^ set(parameters))}")
        shapes = {name: (self.config.vocab_size, *shape[1:]) if padded else shape
                  for name, (shape, padded) in parameters.items()}
        for tensor_map in self._maps:
            if tensor_map in self._absent:
                continue
            expected = converted_shapes(tensor_map.from_mega, [shapes[name] for name in tensor_map.mega])
            for name, shape in zip(tensor_map.other, expected, strict=True):
                stored = self._stored[name]
                if self._weights.shape(stored) != shape:
                    raise ConversionError(f"{self._weights.file(stored)}: {stored} has shape "
                                          f"{list(self._weights.shape(stored))}, but {config_path} implies "
                                          f"{list(shape)}; the weights and the config disagree")
            dtypes = {self._weights.dtype(self._stored[name]) for name in tensor_map.other}
            for name in tensor_map.other:
                dtype = self._weights.dtype(self._stored[name])
                if not dtype.is_floating_point:
                    raise ConversionError(f"{self._weights.file(self._stored[name])}: {self._stored[name]} is stored "
                                          f"as {str(dtype).removeprefix('torch.')}; a model weight must be floating "
                                          "point (is the header's dtype wrong?)")
            if len(dtypes) > 1:
                raise ConversionError(f"{self.directory}: {format_names(tensor_map.other)} are converted together "
                                      f"but have different dtypes ({', '.join(map(str, dtypes))})")
        return shapes

    def _extra_tensors(self, names: set[str], ignored: tuple[str, ...]) -> None:
        """The files' tensors no map takes: second copies of a tensor (each must equal it), buffers
        transformers computes (kept when they are its values), ignored ones; any other is unused."""
        mapping = self._family.hf_mapping
        copies = mapping.copies(self.config) if mapping.copies else {}
        buffers = mapping.buffers(self.config) if mapping.buffers else {}
        self._copies: list[str] = []
        self._buffers: dict[str, str] = {}  # name -> dtype of the buffers written back on export
        unexpected = set()
        for name in sorted(names):
            stored = self._weights.read(self._stored[name]) if name in copies or name in buffers else None
            if name in copies:
                original = copies[name]
                if original not in self._stored or not torch.equal(stored, self._weights.read(self._stored[original])):
                    self._unused([name], f"a copy of {original} in the model the config describes, which it does "
                                         "not equal (or which the files lack)")
                    continue
                self._copies.append(name)
            elif name in buffers and stored.shape == buffers[name].shape and \
                    torch.equal(stored.to(buffers[name].dtype), buffers[name]):
                self._buffers[name] = str(stored.dtype).removeprefix("torch.")
            elif not any(re.fullmatch(pattern, name) for pattern in ignored):
                unexpected.add(name)
        if unexpected:
            self._unused(unexpected, f"which the model {self.directory / CONFIG_FILE} describes does not have")

    def _unused(self, names, why: str) -> None:
        """Tensors of the files the conversion would not use: an error naming them, or with
        ``allow_unused`` (``--allow-unused-tensors``) a warning."""
        message = f"{self.directory} holds {format_names(names)}, {why}"
        if not self.allow_unused:
            raise ConversionError(f"{message}; the weights and the config disagree (--allow-unused-tensors converts "
                                  "without them)")
        self.warnings.append(f"{message}: left out (--allow-unused-tensors)")

    def _absent_maps(self, optional: tuple[str, ...]) -> list[TensorMap]:
        """The maps none of whose tensors the directory holds, all of them optional (a head the
        base model lacks): initialised here, and said so in ``warnings``."""
        absent = [tensor_map for tensor_map in self._maps
                  if not any(name in self._stored for name in tensor_map.other)
                  and all(any(re.fullmatch(pattern, name) for pattern in optional) for name in tensor_map.other)]
        if absent:
            # Named by module (cls.predictions.*), not tensor by tensor: a head is what is missing.
            modules = dict.fromkeys(".".join(name.split(".")[:2]) + ".*" for m in absent for name in m.other)
            self.warnings.append(f"{self.directory} has no {', '.join(modules)}: initialised from seed "
                                 f"{DEFAULT_SEED} as training would start them (heads a base model lacks)")
        return absent

    def _convert(self, tensor_map: TensorMap) -> tuple[torch.Tensor, ...]:
        if tensor_map in self._absent:
            return tuple(self._initialised(name) for name in tensor_map.mega)
        return tensor_map.to_mega(*(self._weights.read(self._stored[name]) for name in tensor_map.other))

    def _initialised(self, name: str) -> torch.Tensor:
        tensor = torch.empty(self._shapes[name], dtype=self.dtype(name))
        fill = self._family.init_parameter(self.config, name)
        block = torch.empty(tensor.shape, dtype=torch.float32)
        fill(block, parameter_generator(DEFAULT_SEED, name, block.device))
        return tensor.copy_(block)

    # -- ModelSource ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._by_name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        tensor_map, _ = self._by_name[name]
        if tensor_map in self._absent:  # initialised in the dtype of the weights that are there
            return self._weights.dtype(self._stored[self._maps[0].other[0]])
        return self._weights.dtype(self._stored[tensor_map.other[0]])

    def get(self, name: str) -> torch.Tensor:
        return self._converted.output(*self._by_name[name])

    def close(self) -> None:
        self._weights.close()
