"""The format: ``detect(path)``, ``open(path) -> source``, ``write(source, directory, options)``."""

import dataclasses
import json
from pathlib import Path

import torch

from mega.core.plugins import get_plugins

TENSORS, CONFIG = "tensors.pt", "model.json"


class Source:
    """A model's tensors by global (Megatron-Core) name, and its family and config."""

    def __init__(self, path: Path):
        saved = json.loads((path / CONFIG).read_text(encoding="utf-8"))
        family = get_plugins().models.get(saved["family"])
        self.family, self.config = saved["family"], family.config_class(**saved["config"])
        self.tokenizer, self.tokenizer_extras = None, {}
        self._tensors = torch.load(path / TENSORS, map_location="cpu", weights_only=True)

    def names(self):
        return sorted(self._tensors)

    def shape(self, name):
        return tuple(self._tensors[name].shape)

    def dtype(self, name):
        return self._tensors[name].dtype

    def get(self, name):
        return self._tensors[name]

    def close(self):
        self._tensors = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Format:
    name = "plugin_name"

    def detect(self, path) -> bool:
        return (Path(path) / TENSORS).is_file() and (Path(path) / CONFIG).is_file()

    def open(self, path, model_family=None) -> Source:
        return Source(Path(path))

    def write(self, source, directory, options) -> list[str]:
        directory = Path(directory)
        torch.save({name: source.get(name).contiguous() for name in source.names()}, directory / TENSORS)
        config = {f.name: getattr(source.config, f.name) for f in dataclasses.fields(source.config) if f.init}
        (directory / CONFIG).write_text(json.dumps({"family": source.family, "config": config}), encoding="utf-8")
        # Nothing dropped silently: what this format does not keep is said.
        return [] if source.tokenizer is None else [f"plugin_name keeps no tokenizer ({source.tokenizer.type} dropped)"]


FORMAT = Format()
