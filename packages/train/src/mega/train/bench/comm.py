"""``mega bench comm``: measure collectives over torch.distributed the way nccl-tests does.

For each collective and message size: fill, run once and check the result (``#wrong``), run
``-w`` warm-up iterations, then time ``-n`` iterations; the time reported is the slowest rank's
average. As in nccl-tests, ``size`` is the whole buffer in bytes (the gathered output of an
all-gather, the input of a reduce-scatter), ``count`` the elements each rank passes to the call
(for all_gather, reduce_scatter and all_to_all: one rank's share), ``algbw = size / time`` and
``busbw = algbw * factor``, the factor turning it into what each link carries in a ring:

    all_reduce 2(n-1)/n   all_gather (n-1)/n   reduce_scatter (n-1)/n   all_to_all (n-1)/n
    broadcast 1           sendrecv 1 (each rank sends to rank+1 and receives from rank-1)

Runs under torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``), or locally with
``--nproc-per-node N`` (it starts the N processes itself). gloo on CPU, NCCL on GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mega.core.cli.argparser import CommandParser

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv")

# nccl-tests' bus-bandwidth factors.
BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}

# nccl-tests' type names, and torch's.
DTYPES = {
    "int8": "int8", "uint8": "uint8", "int32": "int32", "int": "int32", "int64": "int64",
    "half": "float16", "float16": "float16", "float": "float32", "float32": "float32",
    "double": "float64", "float64": "float64", "bfloat16": "bfloat16",
}

UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


@dataclass
class Row:
    op: str
    size: int  # bytes
    count: int  # elements per rank passed to the call
    dtype: str
    redop: str
    root: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)([KMG]?)B?", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use bytes with an optional K, M or G (e.g. 8, 64K, 128M)")
    return int(match.group(1)) * UNITS[match.group(2)]


def message_sizes(minbytes: int, maxbytes: int, factor: float, step: int) -> list[int]:
    sizes, size = [], minbytes
    while size <= maxbytes:
        sizes.append(size)
        size = size + step if step else int(size * factor)
    return sizes


def bus_bandwidth(op: str, algbw: float, world_size: int) -> float:
    return algbw * BUS_FACTORS[op](world_size)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="mega bench comm",
        description="Measure collectives over torch.distributed the way nccl-tests does "
                    "(run under torchrun, or with --nproc-per-node N).",
    )
    parser.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"), help="smallest message (8)")
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("32M"), help="largest message (32M)")
    parser.add_argument("-f", "--stepfactor", type=float, default=2.0, help="multiply the size by this (2)")
    parser.add_argument("-i", "--stepbytes", type=parse_size, default=0, help="add this to the size instead")
    parser.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size (20)")
    parser.add_argument("-w", "--warmup-iters", type=int, default=5, help="untimed iterations first (5)")
    parser.add_argument("-d", "--datatype", default="float", choices=sorted(DTYPES), help="element type (float)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {', '.join(OPS)} (all)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="default: nccl when a CUDA device is present, else gloo")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="start this many local processes (instead of running under torchrun)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser


def _validate(args: argparse.Namespace) -> str | None:
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = sorted(set(ops) - set(OPS))
    if unknown or not ops:
        return f"--ops: unknown collective(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(OPS)}"
    args.ops = ops
    if args.minbytes < 1 or args.maxbytes < args.minbytes:
        return f"-b/--minbytes ({args.minbytes}) must be >= 1 and <= -e/--maxbytes ({args.maxbytes})"
    if not args.stepbytes and args.stepfactor <= 1:
        return f"-f/--stepfactor must be > 1, got {args.stepfactor}"
    if args.iters < 1 or args.warmup_iters < 0:
        return f"-n/--iters must be >= 1 and -w/--warmup-iters >= 0, got {args.iters} and {args.warmup_iters}"
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        return f"--nproc-per-node must be >= 1, got {args.nproc_per_node}"
    if args.nproc_per_node is None and "RANK" not in os.environ:
        return "run under torchrun (RANK/WORLD_SIZE set) or pass --nproc-per-node N"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    problem = _validate(args)
    if problem:
        print(f"mega bench comm: {problem}", file=sys.stderr)
        return 2
    if args.nproc_per_node is not None:
        return _spawn(args)
    return _run(args)


def _spawn(args: argparse.Namespace) -> int:
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:
        mp.start_processes(_spawned_rank, args=(args.nproc_per_node, port, vars(args)),
                           nprocs=args.nproc_per_node, join=True, start_method="spawn")
    except mp.ProcessRaisedException as error:
        print(f"mega bench comm: a rank failed:\n{error}", file=sys.stderr)
        return 1
    return 0


def _spawned_rank(local_rank: int, world_size: int, port: int, options: dict) -> None:
    os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    _run(argparse.Namespace(**options))


def _default_backend() -> str:
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return "nccl" if accelerator is not None and accelerator.type == "cuda" else "gloo"


def _run(args: argparse.Namespace) -> int:
    backend = args.backend or _default_backend()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(backend, init_method="env://", device_id=device if backend == "nccl" else None)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        dtype = getattr(torch, DTYPES[args.datatype])
        rows = [measure(op, size, dtype, device, args.iters, args.warmup_iters)
                for op in args.ops
                for size in message_sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)]
        rows = [row for row in rows if row is not None]
        if rank == 0:
            header = {"world_size": world, "backend": backend, "device": device.type, "dtype": str(dtype)[6:],
                      "iters": args.iters, "warmup_iters": args.warmup_iters}
            if args.json:
                print(json.dumps({**header, "results": [asdict(row) for row in rows]}, indent=2))
            else:
                print(format_table(header, rows))
    finally:
        dist.destroy_process_group()
    return 0


def measure(op: str, size: int, dtype, device, iters: int, warmup: int) -> Row | None:
    """Check and time one collective at one message size; ``None`` if the size holds no element."""
    rank, world = dist.get_rank(), dist.get_world_size()
    itemsize = torch.empty((), dtype=dtype).element_size()
    shared = op in ("all_gather", "reduce_scatter", "all_to_all")  # the buffer is split over ranks
    count = size // (itemsize * world) if shared else size // itemsize
    if count == 0:
        return None
    total = count * world if shared else count
    run, check = _collective(op, count, total, dtype, device, rank, world)

    wrong = check()
    for _ in range(warmup):
        run()
    _synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    _synchronize(device)
    seconds = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    wrong_total = torch.tensor([wrong], dtype=torch.int64, device=device)
    dist.all_reduce(wrong_total)
    seconds = seconds.item()
    nbytes = total * itemsize
    algbw = nbytes / seconds / 1e9
    return Row(op, nbytes, count, str(dtype)[6:], "sum" if op in ("all_reduce", "reduce_scatter") else "none",
               0 if op == "broadcast" else -1, seconds * 1e6, algbw, bus_bandwidth(op, algbw, world),
               int(wrong_total.item()))


def _collective(op: str, count: int, total: int, dtype, device, rank: int, world: int):
    """``run()`` for timing and ``check()`` (fill, run once, count wrong elements) for one op."""
    # torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
    all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def full(n, value):
        return torch.full((n,), value, dtype=dtype, device=device)

    def mismatches(actual, expected):
        return int((actual != expected).sum().item())

    if op == "all_reduce":
        buf = full(count, 0)
        expected = sum(range(1, world + 1))

        def run():
            dist.all_reduce(buf)

        def check():
            buf.fill_(rank + 1)
            run()
            return mismatches(buf, full(count, expected))
    elif op == "all_gather":
        send, recv = full(count, rank + 1), full(total, 0)
        expected = torch.arange(1, world + 1, device=device).to(dtype).repeat_interleave(count)

        def run():
            all_gather_flat(recv, send)

        def check():
            run()
            return mismatches(recv, expected)
    elif op == "reduce_scatter":
        send, recv = full(total, rank + 1), full(count, 0)

        def run():
            reduce_scatter_flat(recv, send)

        def check():
            run()
            return mismatches(recv, full(count, sum(range(1, world + 1))))
    elif op == "all_to_all":
        # Chunk j of rank r holds r*world + j; after the exchange, chunk j of rank r holds j*world + r.
        send = (torch.arange(world, device=device) + rank * world).to(dtype).repeat_interleave(count)
        recv = full(total, 0)
        expected = (torch.arange(world, device=device) * world + rank).to(dtype).repeat_interleave(count)

        def run():
            dist.all_to_all_single(recv, send)

        def check():
            run()
            return mismatches(recv, expected)
    elif op == "broadcast":
        buf = full(count, 0)

        def run():
            dist.broadcast(buf, src=0)

        def check():
            buf.fill_(1 if rank == 0 else 0)
            run()
            return mismatches(buf, full(count, 1))
    else:  # sendrecv: a ring, every rank sends and receives at once
        send, recv = full(count, rank + 1), full(count, 0)
        to, frm = (rank + 1) % world, (rank - 1) % world

        def run():
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, to), dist.P2POp(dist.irecv, recv, frm)]):
                work.wait()

        def check():
            run()
            return mismatches(recv, full(count, frm + 1))
    return run, check


def _synchronize(device) -> None:
    if device.type != "cpu":
            torch.accelerator.synchronize(device)


def format_table(header: dict, rows: list[Row]) -> str:
    lines = [f"# mega bench comm: {header['world_size']} ranks, backend {header['backend']}, "
             f"device {header['device']}, dtype {header['dtype']}, "
             f"iters {header['iters']}, warmup {header['warmup_iters']}"]
    columns = ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong")
    units = ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "")
    widths = (12, 12, 9, 6, 5, 10, 8, 8, 7)

    def fmt(cells):
        return " ".join(str(cell).rjust(width) for cell, width in zip(cells, widths, strict=True))

    for op in dict.fromkeys(row.op for row in rows):
        mine = [row for row in rows if row.op == op]
        lines += ["#", f"# {op}", "#" + fmt(columns)[1:], "#" + fmt(units)[1:]]
        for row in mine:
            lines.append(fmt((row.size, row.count, row.dtype, row.redop, row.root, f"{row.time_us:.1f}",
                              f"{row.algbw_gbps:.3f}", f"{row.busbw_gbps:.3f}", row.wrong)))
        average = sum(row.busbw_gbps for row in mine) / len(mine)
        lines.append(f"# Avg bus bandwidth ({op}): {average:.3f} GB/s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
