"""The ``hf`` checkpoint format: Hugging Face ``transformers`` model directories (config.json,
safetensors weights, tokenizer files) of the families that declare an ``hf_mapping``, and of the
Llama-like architectures the generic bridge reads as the ``llama`` family (:mod:`.hf_bridge`)."""

from __future__ import annotations

from pathlib import Path

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.formats import WriteOptions
from mega.ckpt_convert.hf_bridge import BRIDGE_FAMILY, as_bridged, bridged_architecture, export_mapping
from mega.ckpt_convert.hf_source import CONFIG_FILE, HFSource, find_family, read_config_json
from mega.ckpt_convert.hf_writer import write_hf
from mega.ckpt_convert.source import ModelSource
from mega.core.plugins import PluginError, get_plugins


def _family(name: str | None, config_json: dict, config_path: Path):
    try:
        bridged = bridged_architecture(config_json)
        if bridged is None:
            return find_family(config_json, config_path, name, get_plugins())
        if name not in (None, BRIDGE_FAMILY):
            raise ConversionError(f"{config_path} describes {bridged}, which mega reads as the {BRIDGE_FAMILY} "
                                  f"family, not --model-family {name}")
        return as_bridged(get_plugins().models.get(BRIDGE_FAMILY), bridged)
    except PluginError as error:
        raise ConversionError(str(error)) from None


class HFFormat:
    name = "hf"

    def detect(self, path: Path) -> bool:
        return (path / CONFIG_FILE).is_file()

    def open(self, path: Path, model_family: str | None = None, allow_unused: bool = False) -> HFSource:
        config_json = read_config_json(path)
        return HFSource(path, _family(model_family, config_json, path / CONFIG_FILE), config_json, allow_unused)

    def write(self, source: ModelSource, directory: Path, options: WriteOptions) -> list[str]:
        family = get_plugins().models.get(source.family)
        if family.hf_mapping is None:
            raise ConversionError(f"model family {source.family!r} has no Hugging Face counterpart")
        mapping = export_mapping(family, source.config, getattr(source, "origin", None))
        return write_hf(source, mapping, directory, options.max_shard_bytes, options.progress,
                        options.with_initialised_heads)


HF_FORMAT = HFFormat()
