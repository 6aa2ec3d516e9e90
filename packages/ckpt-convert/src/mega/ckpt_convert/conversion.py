"""One conversion: open the input in its format, write it in another, all or nothing.

The output is written into a hidden sibling directory and renamed to its name only when
complete, so an error or an interruption leaves no partial output behind.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.formats import WriteOptions, detect_format, get_format
from mega.ckpt_convert.source import CastSource


def convert(input_path: str | os.PathLike, output_path: str | os.PathLike, *, to_format: str,
            from_format: str | None = None, model_family: str | None = None, dtype: torch.dtype | None = None,
            options: WriteOptions = WriteOptions(), allow_unused_tensors: bool = False) -> list[str]:
    """Convert the checkpoint at ``input_path`` into ``output_path`` (which must not exist, or be
    an empty directory); returns warnings for the user (e.g. a tokenizer transformers lacks).
    A tensor of the input that the conversion does not use is an error naming it, or with
    ``allow_unused_tensors`` a warning."""
    input_path, output_path = Path(input_path), Path(output_path)
    source_format = get_format(from_format) if from_format else detect_format(input_path)
    target_format = get_format(to_format)
    if not input_path.is_dir():
        raise ConversionError(f"input {input_path} is not a directory")
    if output_path.exists() and (not output_path.is_dir() or any(output_path.iterdir())):
        raise ConversionError(f"output {output_path} already exists and is not empty; choose a new directory")
    if output_path.resolve() == input_path.resolve():
        raise ConversionError("the output directory must differ from the input")
    staging = output_path.parent / f".{output_path.name}.partial-{os.getpid()}"
    output_path.parent.mkdir(parents=True, exist_ok=True)
    # Formats of other distributions may predate allow_unused: it is passed only when asked for.
    source = source_format.open(input_path, model_family, **({"allow_unused": True} if allow_unused_tensors else {}))
    try:
        if dtype is not None:
            source = CastSource(source, dtype)
        staging.mkdir()
        warnings = [*getattr(source, "warnings", []), *target_format.write(source, staging, options)]
        if output_path.exists():  # an empty directory given as the output
            output_path.rmdir()
        os.replace(staging, output_path)
        return warnings
    finally:
        source.close()
        shutil.rmtree(staging, ignore_errors=True)
