"""``mega checkpoint verify DIR``: is every checkpoint in DIR intact, byte for byte, and whole?

Each file is compared with the size and checksum recorded when it was saved, the tensor index
must parse, and it must hold every tensor the save recorded (every parameter's model tensor and
optimizer state, by name and global shape, its pieces covering every element;
:mod:`mega.core.checkpoint.completeness`). DIR is one checkpoint, or a --save directory (then every checkpoint in it is checked:
a damaged newest one is worth knowing about before an older one is pruned).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mega.core.checkpoint.directory import RELEASE, saved_iterations, verify
from mega.core.checkpoint.foreign import foreign_format
from mega.core.checkpoint.metadata import METADATA_FILE, CheckpointError
from mega.core.cli.argparser import CommandParser


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="mega checkpoint verify",
        description="Check that checkpoints are complete and unchanged since they were saved: every file "
                    "at its recorded size and checksum, the tensor index readable and holding every tensor the "
                    "save recorded (each parameter's weights and optimizer state, at its shape, every element "
                    "written). DIR is one checkpoint "
                    "or a --save directory (every checkpoint in it). Exit 0 when all are intact, 1 otherwise.",
    )
    parser.add_argument("directory", metavar="DIR")
    parser.add_argument("--json", action="store_true",
                        help="print the result as JSON: every checkpoint's path, intact, error")
    return parser


def checkpoints_in(directory: Path) -> list[Path]:
    if (directory / METADATA_FILE).exists():
        return [directory]
    found = [path for _, path in saved_iterations(directory)]
    return found + ([directory / RELEASE] if (directory / RELEASE).is_dir() else [])


def check(checkpoint: Path) -> None:
    """Raise :class:`CheckpointError` naming what is wrong with ``checkpoint``."""
    # start-up cost: torch, only once there is work
    from mega.core.checkpoint.completeness import check_complete
    from mega.core.checkpoint.sharded_io import read_index

    metadata = verify(checkpoint, checksums=True)
    check_complete(checkpoint, metadata, read_index(checkpoint))
    if not metadata.checksums:
        raise CheckpointError(f"{checkpoint} was saved without checksums (an older mega): only its sizes "
                              "could be checked")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    directory = Path(args.directory)
    if not directory.is_dir():
        print(f"mega checkpoint verify: {directory} does not exist or is not a directory", file=sys.stderr)
        return 1
    checkpoints = checkpoints_in(directory)
    other = None if _holds_mega_metadata(checkpoints) else _other_format(directory)
    if other is not None:  # a Megatron-LM save directory: iter_N directories too, but no damage in them
        print(f"mega checkpoint verify: {directory} holds a {other} checkpoint, not a mega one: only mega "
              "checkpoints record the checksums this checks (`mega checkpoint info` describes it)", file=sys.stderr)
        return 1
    if not checkpoints:
        print(f"mega checkpoint verify: {directory} holds no mega checkpoint", file=sys.stderr)
        return 1
    results = []
    for checkpoint in checkpoints:
        try:
            check(checkpoint)
            results.append({"path": str(checkpoint), "intact": True, "error": None})
        except CheckpointError as error:
            results.append({"path": str(checkpoint), "intact": False, "error": str(error)})
    intact = sum(result["intact"] for result in results)
    if args.json:
        print(json.dumps({"directory": str(directory), "intact": intact, "checkpoints": results}, indent=2))
    else:
        for result in results:
            print(f"ok       {result['path']}" if result["intact"] else f"DAMAGED  {result['path']}: {result['error']}")
        print(f"{intact} of {len(results)} checkpoint(s) intact")
    return 0 if intact == len(results) else 1


def _holds_mega_metadata(checkpoints: list[Path]) -> bool:
    return any((checkpoint / METADATA_FILE).exists() for checkpoint in checkpoints)


def _other_format(directory: Path) -> str | None:
    """The name of the checkpoint format other than mega's that recognises ``directory``, if any."""
    other = foreign_format(directory, capability="describe")
    return None if other is None else getattr(other, "name", type(other).__name__)
