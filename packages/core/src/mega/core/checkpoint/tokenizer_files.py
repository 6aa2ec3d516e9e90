"""The run's tokenizer travels with its checkpoints: its files under ``tokenizer/``, its type and
options in the metadata, so generation and conversion need nothing from the training machine."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from mega.core.checkpoint.directory import checkpoint_and_metadata
from mega.core.checkpoint.metadata import CheckpointError, CheckpointMetadata
from mega.core.plugins import get_plugins
from mega.core.tokenizer import TokenizerOptions, TokenizerSpec

TOKENIZER_DIR = "tokenizer"
FILE_OPTIONS = ("vocab_file", "merge_file", "tokenizer_model")


# Files beside a Hugging Face tokenizer that name its special tokens (eos, bos, pad) and chat
# template: they travel with it, or a reloaded tokenizer would have to guess its end of text.
TOKEN_DESCRIPTION_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                           "chat_template.jinja")


def option_file(value: str) -> Path:
    """The file a tokenizer option names: a Hugging Face tokenizer's directory stands for its
    ``tokenizer.json`` (the file that travels, under its own name)."""
    path = Path(value)
    return path / "tokenizer.json" if path.is_dir() and (path / "tokenizer.json").is_file() else path


def copy_tokenizer_files(spec: TokenizerSpec | None, checkpoint_dir: Path, extra_files: Sequence[Path] = ()) -> None:
    """The files ``spec`` names (and the token descriptions beside them), and ``extra_files``,
    into ``checkpoint_dir/tokenizer/``."""
    sources = [option_file(source) for option in FILE_OPTIONS
               if spec is not None and (source := getattr(spec.options, option)) and option_file(source).is_file()]
    described = [source.parent / name for source in sources for name in TOKEN_DESCRIPTION_FILES
                 if (source.parent / name).is_file()]
    extra_names = {Path(extra).name for extra in extra_files}
    described = [path for path in dict.fromkeys(described) if path.name not in extra_names]
    for source in [*sources, *described, *map(Path, extra_files)]:
        target = checkpoint_dir / TOKENIZER_DIR / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


def tokenizer_entry(spec: TokenizerSpec | None) -> dict | None:
    """The metadata's record of ``spec``: option files by their name under ``tokenizer/``."""
    if spec is None:
        return None
    options = dataclasses.asdict(spec.options)
    for option in FILE_OPTIONS:
        if options[option]:
            options[option] = option_file(options[option]).name
    return {"type": spec.type, "options": options}


def tokenizer_spec(checkpoint_dir: Path, metadata: CheckpointMetadata) -> TokenizerSpec | None:
    """The spec recorded in ``metadata``, its files resolved inside ``checkpoint_dir``."""
    if metadata.tokenizer is None:
        return None
    options = dict(metadata.tokenizer["options"])
    for option in FILE_OPTIONS:
        if options.get(option):
            path = checkpoint_dir / TOKENIZER_DIR / options[option]
            if not path.is_file():
                raise CheckpointError(f"{checkpoint_dir} names tokenizer file {options[option]}, "
                                      f"which is missing from {TOKENIZER_DIR}/")
            options[option] = str(path)
    return TokenizerSpec(metadata.tokenizer["type"], TokenizerOptions(**options))


def load_tokenizer(path: str | os.PathLike, plugins=None):
    """The tokenizer a checkpoint was trained with (None when it recorded none)."""
    spec = tokenizer_spec(*checkpoint_and_metadata(path))
    return spec.build(plugins or get_plugins()) if spec else None
