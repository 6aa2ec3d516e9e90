"""Megatron-LM checkpoints on a ~1B-parameter LLaMA-style model: peak RSS of importing a torch_dist
checkpoint against its bytes (target < 30%), and of the other directions, with their times.

    python benchmarks/bench_megatron_import.py [--dtype bf16] [--workdir DIR] [--json PATH]

The model is bench_convert's (TinyLlama-1.1B's shape, random weights) written as a Hugging Face
directory by a child process, then converted with ``mega convert``, each run in a fresh process
whose peak RSS comes from ``wait4``:

    hf -> megatron torch_dist (tp1)          the checkpoint the import reads
    megatron torch_dist -> mega (tp1)        the import measured against the target
    megatron torch_dist -> megatron legacy (tp2 x pp2)
    megatron legacy -> mega (tp1)

The floor is a process that imports what a conversion imports and converts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_convert import DTYPES, measure_conversions, write_model_in_child  # noqa: E402

FLOOR = ("import torch, mega.ckpt_convert.cli, mega.ckpt_convert.megatron.format, "
         "mega.ckpt_convert.mega_format; from mega.core.plugins import get_plugins; get_plugins().models.get('llama')")


def weight_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for pattern in ("*.distcp", "model_optim_rng.pt") for path in directory.rglob(pattern))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of the synthetic weights")
    parser.add_argument("--workdir", type=Path, help="where to write the checkpoints (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        root = Path(workdir)
        model_bytes = write_model_in_child(root, args.dtype)
        convert = [sys.executable, "-m", "mega.core.cli.main", "convert", "--progress", "never"]
        runs = {
            "hf -> megatron torch_dist (tp1)": [*convert, "--to", "megatron", "--megatron-format", "torch_dist",
                                                "--input", str(root / "hf"), "--output", str(root / "dist")],
            "megatron torch_dist -> mega (tp1)": [*convert, "--from", "megatron", "--to", "mega",
                                                  "--input", str(root / "dist"), "--output", str(root / "mega")],
            "megatron torch_dist -> megatron legacy (tp2 x pp2)": [
                *convert, "--from", "megatron", "--to", "megatron", "--megatron-format", "legacy",
                "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2",
                "--input", str(root / "dist"), "--output", str(root / "legacy")],
            "megatron legacy -> mega (tp1)": [*convert, "--from", "megatron", "--to", "mega",
                                              "--input", str(root / "legacy"), "--output", str(root / "mega2")],
        }
        results = {"dtype": args.dtype, **measure_conversions(runs, model_bytes, FLOOR, weight_bytes,
                                                                exact_size=False)}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
