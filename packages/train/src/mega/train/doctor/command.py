"""``mega doctor``: one line per check (pass / warn / fail / skip); exits 1 if any check fails."""

from __future__ import annotations

import json
from dataclasses import asdict

from mega.core.cli.argparser import CommandParser
from mega.train.doctor.checks import FAIL, run_checks

MARKS = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "skip": "SKIP"}


def report_lines(checks) -> list[str]:
    lines = []
    width = max(len(check.name) for check in checks)
    for check in checks:
        first, *rest = check.detail.split("\n")
        lines.append(f"{MARKS[check.status]}  {check.name.ljust(width)}  {first}")
        lines += [f"      {' ' * width}    {line}" for line in rest]
        if check.advice:
            lines.append(f"      {' ' * width}  -> {check.advice}")
    return lines


def main(argv: list[str]) -> int:
    parser = CommandParser(
        prog="mega doctor",
        description="Check that Python, torch, the CUDA runtime and driver, cuDNN and NCCL agree; list the "
                    "GPUs and advise tensor-parallel groups from `nvidia-smi topo -m`; list mega's packages, "
                    "plugins and kernel backends and the environment variables that change training. "
                    "Exits 1 if a check fails.")
    parser.add_argument("--json", action="store_true", help="print the checks and facts as JSON")
    args = parser.parse_args(argv)
    checks, facts = run_checks()
    failed = any(check.status == FAIL for check in checks)
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in checks], "facts": facts, "ok": not failed}, indent=2))
    else:
        if not facts["gpus"]:
            print("mega doctor: no GPU here; checking what applies to a CPU machine")
        print("\n".join(report_lines(checks)))
        counts = {status: sum(c.status == status for c in checks) for status in MARKS}
        print(", ".join(f"{n} {status}" for status, n in counts.items() if n))
    return 1 if failed else 0
