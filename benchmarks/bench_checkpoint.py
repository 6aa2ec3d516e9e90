"""Checkpoint save and load time, and how long ``--async-save`` blocks the step loop.

Builds a GPT (default: 8 layers, hidden 1024, vocab 32000: 134M parameters, 537 MB of fp32
weights; with Adam's moments the checkpoint is about 1.6 GB), trains one step on mock data in
one process, then times through the same Checkpointer ``mega train --save/--load`` uses:

* a synchronous save (shards written and fsynced, metadata, rename, tracker);
* an asynchronous save: the time the step loop is blocked (snapshot of the tensors), and the
  time until the background write is published;
* a load of that checkpoint (weights, Adam moments, run state).

    python benchmarks/bench_checkpoint.py [--layers 8] [--hidden 1024] [--vocab 32000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path


def build_trainer(args, save_dir: Path, load: bool):
    from mega.core.parallel import ParallelGroups
    from mega.core.plugins import get_plugins
    from mega.train.command import parse_run
    from mega.train.data_setup import build_datasets
    from mega.train.run_config import derive
    from mega.train.trainer import Trainer

    argv = ["--mock-data", "--model-family", "gpt", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
            "--num-attention-heads", str(args.hidden // 64), "--seq-length", "128", "--vocab-size", str(args.vocab),
            "--micro-batch-size", "1", "--train-iters", "1", "--eval-iters", "0", "--log-interval", "1000",
            "--save", str(save_dir)] + (["--load", str(save_dir)] if load else [])
    run, family = parse_run(argv)
    run, derived = derive(run, 1)
    plugins = get_plugins()
    run, data = build_datasets(run, derived, plugins)
    return Trainer(run, derived, family, plugins, data, ParallelGroups(run.parallel))


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()

    root = Path(args.dir or tempfile.mkdtemp(prefix="mega-bench-ckpt-"))
    save_dir = root / "ckpt"
    shutil.rmtree(save_dir, ignore_errors=True)
    try:
        trainer = build_trainer(args, save_dir, load=False)
        trainer.train()  # one step (saves at the end: a warm-up of the same path)
        weights = sum(p.numel() * p.element_size() for c in trainer.chunks for p in c.parameters())
        checkpointer = trainer.checkpointer

        start = time.perf_counter()
        path = checkpointer.save()
        sync_s = time.perf_counter() - start
        size = directory_bytes(path)

        checkpointer.config = dataclasses.replace(checkpointer.config, async_save=True)
        start = time.perf_counter()
        checkpointer.save()
        blocked_s = time.perf_counter() - start
        checkpointer.wait()
        async_total_s = time.perf_counter() - start

        start = time.perf_counter()
        build_trainer(args, save_dir, load=True)
        load_total_s = time.perf_counter() - start
        # the load alone, into the model already built
        checkpointer.config = dataclasses.replace(checkpointer.config, load=str(save_dir))
        start = time.perf_counter()
        checkpointer.load()
        load_s = time.perf_counter() - start
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    print(f"model: gpt {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: "
          f"{weights / 1e6:.0f} MB of fp32 weights; checkpoint {size / 1e6:.0f} MB (weights + Adam moments)")
    print(f"{'operation':<34}{'seconds':>9}{'GB/s':>8}")
    for name, seconds in [("save (synchronous)", sync_s), ("async save: step loop blocked", blocked_s),
                          ("async save: until published", async_total_s), ("load (into a built model)", load_s),
                          ("load incl. building the model", load_total_s)]:
        print(f"{name:<34}{seconds:>9.2f}{size / seconds / 1e9:>8.2f}")
    print(f"async save blocks the step loop {blocked_s / sync_s * 100:.0f}% as long as a synchronous save")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
