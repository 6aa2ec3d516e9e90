"""Checkpoints of other formats (a Megatron-LM save directory...) where a mega checkpoint is expected.

The core reads only its own format; the checkpoint-format plugins (``register_checkpoint_formats``,
mega-ckpt-convert's ``megatron`` and ``hf``) recognise others, open them as sources of global
tensors by Megatron-Core name, and may ``describe(path)`` them for ``mega checkpoint info``.
A format whose ``load_for_training`` is true is converted on the fly by ``mega train --load``.
"""

from __future__ import annotations

from pathlib import Path

from mega.core.plugins import get_plugins

OWN_FORMAT = "mega"


def foreign_format(path: str | Path, plugins=None, capability: str | None = None):
    """The registered checkpoint format, other than mega's own, that recognises ``path`` (and has
    the attribute ``capability`` true, when given); or None."""
    path = Path(path)
    if not path.is_dir():
        return None
    registry = (plugins or get_plugins()).checkpoint_formats
    for name in registry.names():
        if name != OWN_FORMAT:
            checkpoint_format = registry.get(name)
            if capability is not None and not getattr(checkpoint_format, capability, False):
                continue
            if checkpoint_format.detect(path):
                return checkpoint_format
    return None
