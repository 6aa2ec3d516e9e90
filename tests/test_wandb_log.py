"""`--wandb-project` (issue 36, item 5): an offline W&B run holds the console line's values."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from mega.train.command import main

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
        "--mock-data", "--log-interval", "2", "--log-throughput"]


def console_values(out: str) -> dict[int, dict[str, str]]:
    """iteration -> the console line's numbers as printed, parsed as a reader of Megatron's logs would."""
    fields = {"lm loss": "lm loss", "learning rate": "learning-rate", "grad norm": "grad-norm",
              "throughput per GPU (TFLOP/s/GPU)": "throughput", "tokens per second per GPU": "tokens-per-second-per-gpu",
              "elapsed time per iteration (ms)": "iteration-time"}
    lines = {}
    for line in out.splitlines():
        match = re.match(r" iteration +(\d+)/", line)
        if match:
            values = dict(part.strip().rsplit(": ", 1) for part in line.split("|")[1:] if ": " in part)
            lines[int(match.group(1))] = {key: values[name] for name, key in fields.items()}
    return lines


def last_digit(printed: str) -> float:
    """The value of one unit in the last printed digit: 1E-6 for 1.234567E+00, 0.001 for 0.123."""
    mantissa, _, exponent = printed.upper().partition("E")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


def test_an_offline_wandb_run_holds_the_values_of_the_console_lines(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    argv = TINY + ["--wandb-project", "mega-test", "--wandb-exp-name", "tiny", "--wandb-save-dir", str(tmp_path)]
    assert main(argv) == 0
    console = console_values(capsys.readouterr().out)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    logged = history(run_dir)
    assert sorted(console) == [2, 4] and sorted(logged) == [2, 4]
    for iteration, line in console.items():
        row = dict(logged[iteration], **{"iteration-time": 1000 * logged[iteration]["iteration-time"]})
        for key, printed in line.items():  # equal at the digits the console shows
            assert abs(row[key] - float(printed)) <= 0.5 * last_digit(printed) * (1 + 1e-9), (iteration, key, row[key], printed)
    settings = config(run_dir)
    assert settings["training"]["train_iters"] == 4 and settings["model"]["hidden_size"] == 32
    assert settings["logging"]["wandb_project"] == "mega-test"


# -- reading an offline W&B run back from its files ------------------------------------------
# The run's ``run-ID.wandb`` transaction log is LevelDB's log format (32 KiB blocks of records:
# CRC-32C, length, type FULL/FIRST/MIDDLE/LAST) after a 7-byte header (``:W&B``, a magic number,
# a version); each record is a ``wandb.proto.wandb_internal_pb2.Record``. wandb 0.31 ships no
# Python reader of it, so the test reads it with wandb's own protobuf classes.

BLOCK = 32 * 1024
HEADER = 7  # checksum (4), length (2), type (1) of each record, and the size of the file header
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    offset, pending = HEADER, b""
    while offset + HEADER <= len(data):
        room = BLOCK - offset % BLOCK
        if room < HEADER:  # a block's tail too short for a header is padding
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + HEADER])
        if kind == 0 and length == 0:
            break
        payload = data[offset + HEADER:offset + HEADER + length]
        offset += HEADER + length
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def history(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> {key: value} of every history row the run logged."""
    (log,) = run_dir.glob("run-*.wandb")
    rows = {}
    for record in records(log):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows[int(row["_step"])] = row
    return rows


def config(run_dir: Path) -> dict:
    (log,) = run_dir.glob("run-*.wandb")
    values = {}
    for record in records(log):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):  # the configuration given to wandb.init, then any updates
            for item in (record.run.config if kind == "run" else record.config).update:
                values[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return values
