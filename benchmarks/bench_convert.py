"""``mega convert`` on a ~1B-parameter LLaMA-style model: peak RSS against the model's bytes, and time.

    python benchmarks/bench_convert.py [--dtype bf16] [--workdir DIR] [--json PATH]

The model has TinyLlama-1.1B's shape (22 layers, hidden 2048, ffn 5632, 32 heads in 4 key/value
groups, vocabulary 32000, untied) and random weights, written as a Hugging Face directory
(config.json + safetensors shards of at most 2 GB) a tensor at a time by mega's own streaming
writer, so making it costs no model-sized memory either. Each conversion then runs as
``mega convert`` in a fresh process whose peak RSS comes from ``wait4``:

    hf -> mega (tp1),  mega -> mega (reshard to tp2 x pp2),  mega -> hf,  hf -> hf

The floor is the peak RSS of a process that only imports what a conversion imports (Python,
torch, the plugins, the model family) and converts nothing; the target is a peak under 30% of the
model's bytes. Every output is checked to hold the model's number of bytes of weights. The
benchmark's own process imports no torch and makes the model in a child: on Linux a child's peak
RSS starts at its parent's size when it forks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SHAPE = dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
BYTES_PER_PARAMETER = {"bf16": 2, "fp16": 2, "fp32": 4}
FLOOR = ("import torch, mega.ckpt_convert.cli, mega.ckpt_convert.hf_format, mega.ckpt_convert.mega_format; "
         "from mega.core.plugins import get_plugins; get_plugins().models.get('llama')")


def write_synthetic_model(directory: Path, dtype_name: str) -> int:
    """Random weights of the LLaMA shape as a Hugging Face directory; returns the weights' bytes.
    Runs in a child process (``--write-model``)."""
    import torch

    from mega.ckpt_convert.hf_weights import write_hf_weights
    from mega.ckpt_convert.safetensors_io import TensorToWrite
    from mega.ckpt_convert.source import model_parameters
    from mega.ckpt_convert.tensor_maps import converted_shapes
    from mega.core.plugins import get_plugins

    family = get_plugins().models.get("llama")
    config_json = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": dtype_name, **SHAPE}
    config = family.hf_mapping.config_from_hf(config_json)
    shapes = {name: (config.vocab_size, *shape[1:]) if padded else shape
              for name, (shape, padded) in model_parameters(family, config).items()}
    dtype, generator = getattr(torch, dtype_name), torch.Generator().manual_seed(0)
    tensors = []
    for tensor_map in family.hf_mapping.tensor_maps(config):
        out_shapes = converted_shapes(tensor_map.from_mega, [shapes[name] for name in tensor_map.mega])
        for name, shape in zip(tensor_map.other, out_shapes, strict=True):
            tensors.append(TensorToWrite(name, shape, dtype,
                                         lambda s=shape: (torch.randn(s, generator=generator) * 0.02).to(dtype)))
    directory.mkdir(parents=True)
    write_hf_weights(directory, tensors, max_shard_bytes=2 * 10**9)
    (directory / "config.json").write_text(json.dumps(config_json, indent=2))
    return sum(tensor.nbytes for tensor in tensors)


def run_measured(argv: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of a fresh process running ``argv``."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, env={**os.environ, "OMP_NUM_THREADS": "1"})
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed with status {process.returncode}")
    return seconds, usage.ru_maxrss * 1024  # Linux reports KiB


def weight_bytes(directory: Path) -> int:
    files = list(directory.rglob("*.safetensors")) or list(directory.rglob("*.distcp"))
    return sum(path.stat().st_size for path in files)


def write_model_in_child(root: Path, dtype_name: str) -> int:
    """Write the synthetic model to ``root/hf`` from a child process (so its memory is not
    counted anywhere), print its size and return its weight bytes."""
    start = time.perf_counter()
    model_bytes = int(subprocess.run([sys.executable, __file__, "--write-model", str(root / "hf"), "--dtype",
                                      dtype_name], check=True, capture_output=True, text=True).stdout)
    print(f"synthetic LLaMA-style model: {model_bytes / BYTES_PER_PARAMETER[dtype_name] / 1e9:.2f}B "
          f"parameters, {model_bytes / 2**30:.2f} GiB of {dtype_name} weights, written in "
          f"{time.perf_counter() - start:.1f} s")
    return model_bytes


def measure_conversions(runs: dict[str, list[str]], model_bytes: int, floor_script: str,
                        written_bytes: Callable[[Path], int], *, exact_size: bool = True) -> dict:
    """Run each conversion in a fresh process and print a table of time, speed and peak RSS
    against the model's bytes and against ``floor_script`` (the imports alone). The output's
    weights must come to the model's bytes (``exact_size``) or at least to them."""
    _, floor = run_measured([sys.executable, "-c", floor_script])
    results = {"model_bytes": model_bytes, "floor_rss_bytes": floor, "runs": {}}
    print("\n| conversion | time (s) | GB/s | peak RSS (MiB) | peak RSS / model bytes | above floor / model bytes |")
    print("|---|---|---|---|---|---|")
    print(f"| floor: imports only | - | - | {floor / 2**20:.0f} | {floor / model_bytes:.1%} | - |")
    for name, argv in runs.items():
        seconds, rss = run_measured(argv)
        written = written_bytes(Path(argv[argv.index("--output") + 1]))
        too_many = exact_size and written > 1.01 * model_bytes + 2**20
        if written < 0.99 * model_bytes or too_many:
            raise SystemExit(f"{name}: wrote {written} bytes of weights, expected about {model_bytes}")
        results["runs"][name] = {"seconds": seconds, "peak_rss_bytes": rss}
        print(f"| {name} | {seconds:.1f} | {model_bytes / seconds / 1e9:.2f} | {rss / 2**20:.0f} | "
              f"{rss / model_bytes:.1%} | {(rss - floor) / model_bytes:.1%} |", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of the synthetic weights")
    parser.add_argument("--workdir", type=Path, help="where to write the checkpoints (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--write-model", type=Path, help=argparse.SUPPRESS)  # the child that makes the model
    args = parser.parse_args()
    if args.write_model:
        print(write_synthetic_model(args.write_model, DTYPES[args.dtype]))
        return 0

    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        root = Path(workdir)
        model_bytes = write_model_in_child(root, args.dtype)
        convert = [sys.executable, "-m", "mega.core.cli.main", "convert", "--progress", "never"]
        runs = {
            "hf -> mega (tp1)": [*convert, "--to", "mega", "--input", str(root / "hf"), "--output", str(root / "mega")],
            "mega -> mega (tp2 x pp2)": [*convert, "--to", "mega", "--input", str(root / "mega"),
                                         "--output", str(root / "mega-tp2pp2"), "--target-tensor-parallel-size", "2",
                                         "--target-pipeline-parallel-size", "2"],
            "mega -> hf": [*convert, "--to", "hf", "--input", str(root / "mega-tp2pp2"), "--output", str(root / "hf-back")],
            "hf -> hf": [*convert, "--to", "hf", "--input", str(root / "hf"), "--output", str(root / "hf-copy")],
        }
        results = {"dtype": args.dtype, **measure_conversions(runs, model_bytes, FLOOR, weight_bytes)}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
