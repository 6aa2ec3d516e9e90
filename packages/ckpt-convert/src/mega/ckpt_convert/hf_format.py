"""The ``hf`` checkpoint format: Hugging Face ``transformers`` model directories (config.json,
safetensors weights, tokenizer files) of the families that declare an ``hf_mapping``."""

from __future__ import annotations

from pathlib import Path

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.formats import WriteOptions
from mega.ckpt_convert.hf_source import CONFIG_FILE, HFSource, find_family, read_config_json
from mega.ckpt_convert.hf_writer import write_hf
from mega.ckpt_convert.source import ModelSource
from mega.core.plugins import PluginError, get_plugins


def _family(name: str | None, config_json: dict, config_path: Path):
    try:
        return find_family(config_json, config_path, name, get_plugins())
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
        return write_hf(source, family.hf_mapping, directory, options.max_shard_bytes, options.progress,
                        options.with_initialised_heads)


HF_FORMAT = HFFormat()
