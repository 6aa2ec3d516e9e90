"""mega-ckpt-convert: checkpoints between Hugging Face ``transformers`` and mega, at any layout.

``open_checkpoint(path)`` reads a checkpoint of any registered format as a model source (the
inference server opens Hugging Face directories with it); ``convert`` writes one in another
format; ``mega convert`` is the command line. Imports stay lazy: importing the package costs
nothing until one of these is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mega.ckpt_convert.conversion import convert
    from mega.ckpt_convert.errors import ConversionError
    from mega.ckpt_convert.formats import WriteOptions, open_checkpoint
    from mega.ckpt_convert.source import ModelSource

__all__ = ["ConversionError", "ModelSource", "WriteOptions", "convert", "open_checkpoint"]

_HOMES = {
    "convert": "mega.ckpt_convert.conversion",
    "ConversionError": "mega.ckpt_convert.errors",
    "WriteOptions": "mega.ckpt_convert.formats",
    "open_checkpoint": "mega.ckpt_convert.formats",
    "ModelSource": "mega.ckpt_convert.source",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'mega.ckpt_convert' has no attribute {name!r}")
    import importlib  # start-up cost: importing the package costs nothing until a name is used

    return getattr(importlib.import_module(_HOMES[name]), name)
