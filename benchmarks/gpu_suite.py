"""Every GPU row of docs/benchmarks.md in one command, for the minutes a lent GPU is there.

    python benchmarks/gpu_suite.py                 # all rows, about 9 minutes on one H100/H200
    python benchmarks/gpu_suite.py --rows gpt-bf16 decode   # some rows
    python benchmarks/gpu_suite.py --dry-run       # on any machine: every row's flags parse
    nox -s gpu                                     # the same as the first line, in the current Python

Each row runs in its own process (a fresh CUDA context, so peak memory is the row's own) under
its own timeout; a row that fails or times out is reported with the end of its output and the
rest still run. Rows run in priority order (the headline figures first) and a row that would
start after ``--budget`` seconds is reported as not run. As each row ends, its JSON goes to
``OUT/gpu_suite.jsonl`` and the markdown table ``OUT/gpu_suite.md`` is rewritten, so an
interrupted run keeps what it measured. The table's ratios compare rows of the same run: FP8
against compiled bf16, mega against Hugging Face, the server against the engine alone.

Install nothing on the GPU machine: build benchmarks/gpu_wheelhouse.sh's folder on a CPU machine
beforehand and install from it offline (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import runpy
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The LLaMA 1.2B shape of gpu-h200.md (1.50B parameters with the untied 128,256-token vocabulary).
LLAMA = ["--preset", "llama3-8b", "--model-family", "llama", "--num-layers", "16", "--hidden-size", "2048",
         "--ffn-hidden-size", "8192", "--num-attention-heads", "32", "--num-query-groups", "8"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]  # compiled: mega train's FP8 default on a GPU
MFU = ["bench_gpu_mfu.py", "--json", "--steps", "8"]
DECODE = ["bench_generate.py", "--family", "llama", "--device", "cuda", "--dtype", "bfloat16", "--layers", "16",
          "--hidden", "2048", "--heads", "16", "--vocab", "128256", "--prompt", "128", "--new-tokens", "128",
          "--repeats", "3", "--no-server", "--json"]
SERVE = ["bench_serve.py", "--device", "cuda", "--dtype", "bfloat16", "--layers", "16", "--hidden", "2048",
         "--heads", "16", "--vocab", "128256", "--clients", "32", "--requests", "128", "--batching", "continuous",
         "--kv-cache", "static", "--engine-baseline", "--json"]


@dataclass
class Row:
    name: str
    argv: list[str]  # the script (in benchmarks/) and its flags
    timeout_s: int
    baseline: str | None = None  # a row of the same run that this row's tokens/s is divided by
    target: str = ""  # the target, as the table shows it
    extra: dict = field(default_factory=dict)


# Priority order: the figures the open GPU issue asks for first.
ROWS = [
    Row("gpt-bf16", MFU, 75, target=">= 55% MFU"),
    Row("gpt-bf16-compile", [*MFU, "--compile"], 110, baseline="gpt-bf16"),
    Row("gpt-fp8-compile", [*MFU, *FP8], 110, baseline="gpt-bf16-compile", target=">= 1.3x compiled bf16"),
    Row("llama-bf16", [*MFU, *LLAMA], 75, target=">= 50% MFU, <= 35 GB"),
    Row("llama-bf16-compile", [*MFU, *LLAMA, "--compile"], 110, baseline="llama-bf16"),
    Row("llama-fp8-compile", [*MFU, *LLAMA, *FP8], 110, baseline="llama-bf16-compile",
        target=">= 1.3x compiled bf16"),
    Row("decode", [*DECODE, "--batches", "1", "16", "32", "--compile"], 150,
        target="batch 1 >= 1,000 tok/s (~60% of bandwidth)"),
    Row("serve-32", SERVE, 150, target=">= 0.8x the engine at batch 32"),
    Row("quantization", ["bench_quantization.py", "--device", "cuda", "--dtype", "bfloat16", "--layers", "16",
                         "--hidden", "2048", "--ffn", "8192", "--heads", "32", "--groups", "8", "--vocab", "128256",
                         "--batches", "1", "16", "--new-tokens", "128", "--json"], 200,
        target="int8 >= 1.5x, int4 >= 2x bf16 at batch 1 (issue 52)"),
    Row("gpt-hf", ["bench_gpu_mfu.py", "--json", "--steps", "8", "--hf", "gpt"], 75, baseline="gpt-bf16"),
    Row("llama-hf", ["bench_gpu_mfu.py", "--json", "--steps", "8", "--hf", "llama"], 75, baseline="llama-bf16"),
    Row("llama-liger-compile", [*MFU, *LLAMA, "--kernels", "liger", "--compile"], 110, baseline="llama-bf16"),
    # The profiles the issue asks for: where the compiled FP8 step's time goes beside compiled bf16
    # (the kernel table by time and category), and the kernels of one captured decode step.
    Row("gpt-fp8-profile", [*MFU[:-2], "--steps", "10", "--profile", "3", *FP8], 120,
        target="kernel table: FP8 casts/amax vs gemm"),
    Row("gpt-bf16-compile-profile", [*MFU[:-2], "--steps", "10", "--profile", "3", "--compile"], 120),
    Row("decode-profile", [*DECODE, "--batches", "1", "--compile", "--profile", "--repeats", "1"], 120,
        target="kernels per decode step"),
    # LLaMA's memory at micro-batch 4 (<= 35 GB): liger's fused linear cross-entropy with
    # selective recompute.
    Row("llama-liger-selective", [*MFU, *LLAMA, "--kernels", "liger", "--compile", "--recompute", "selective"], 110,
        baseline="llama-bf16", target="<= 35 GB at the speed of llama-bf16"),
    # Issue 48: a GRPO step at the LLaMA 1.2B shape (the engine on a model of its own, so the
    # refresh is timed): rollout tokens/s against the engine alone, phases, peak memory.
    Row("rl-step", ["bench_rl_gpu.py", "--json", "--own-engine"], 240,
        target="rollout tok/s vs the engine alone; refresh s; peak memory"),
    Row("muon-vs-adamw", ["bench_optimizers.py", "--gpu", "--iters", "20", "--json"], 240,
        target="optimizer step's share of a GPT 1.3B step (issue 51)"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=[row.name for row in ROWS], help="only these rows")
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder of gpu_suite.jsonl and gpu_suite.md")
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds: a row that would start later is reported as not run (default 540, 9 min)")
    parser.add_argument("--dry-run", action="store_true",
                        help="run nothing: check that every row's script accepts its flags (any machine)")
    args = parser.parse_args(argv)
    rows = [row for row in ROWS if not args.rows or row.name in args.rows]
    if args.dry_run:
        return dry_run(rows)
    return run_rows(rows, args.out, args.budget)


def dry_run(rows: list[Row]) -> int:
    """Parse every row's flags with its script's own parser, every script in one subprocess (the
    imports of torch and the benchmarks' libraries paid once)."""
    pairs = []
    for script in dict.fromkeys(row.argv[0] for row in rows):
        pairs += ["--check-script", script, json.dumps([row.argv[1:] for row in rows if row.argv[0] == script])]
    done = subprocess.run([sys.executable, __file__, *pairs], capture_output=True, text=True)
    print(done.stdout, end="")
    print(done.stderr, end="", file=sys.stderr)
    print("dry run: " + ("every row's flags parse" if done.returncode == 0 else "a script refused its flags"))
    return done.returncode


class _Parsed(Exception):
    """Raised by the patched parse_args once a script's flags parsed: the dry run stops there."""


def check_script(script: str, checks: list[list[str]]) -> int:
    """In this process: parse each flag list with ``script``'s parser. A script that defines
    ``check_flags(argv)`` (bench_gpu_mfu: its unknown flags go to mega train's parser) is asked
    directly; otherwise its ``main()`` runs with ``argparse``'s ``parse_args`` stopping right after
    parsing, so nothing is measured and no device is touched."""
    path = HERE / script
    module = runpy.run_path(str(path), run_name="gpu_suite_check")
    for argv in checks:
        if "check_flags" in module:
            module["check_flags"](argv)
        else:
            original = argparse.ArgumentParser.parse_args

            def parse_then_stop(self, args=None, namespace=None, _original=original):
                _original(self, args, namespace)
                raise _Parsed

            argparse.ArgumentParser.parse_args = parse_then_stop
            sys.argv = [str(path), *argv]
            try:
                module["main"]()
            except _Parsed:
                pass
            else:
                raise SystemExit(f"{script} returned without parsing its flags")
            finally:
                argparse.ArgumentParser.parse_args = original
        print(f"ok   {script} {' '.join(argv)}")
    return 0


def run_rows(rows: list[Row], out: Path, budget: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    header = machine_header()
    results: dict[str, dict] = {}
    start = time.monotonic()
    with open(out / "gpu_suite.jsonl", "a") as log:
        log.write(json.dumps({"header": header}) + "\n")
        for row in rows:
            if time.monotonic() - start + row.timeout_s > budget:
                results[row.name] = {"status": "not run", "why": f"past the {budget:.0f} s budget"}
            else:
                results[row.name] = run_row(row)
            log.write(json.dumps({"row": row.name, "argv": row.argv, **results[row.name]}) + "\n")
            log.flush()
            (out / "gpu_suite.md").write_text(markdown(header, rows, results))
            print(f"{row.name}: {summary(row, results)}", flush=True)
    print((out / "gpu_suite.md").read_text())
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


def run_row(row: Row) -> dict:
    command = [sys.executable, str(HERE / row.argv[0]), *row.argv[1:]]
    began = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=row.timeout_s,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    except subprocess.TimeoutExpired as expired:
        tail = (expired.stderr or b"")[-600:]
        return {"status": "timeout", "seconds": row.timeout_s,
                "why": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    seconds = round(time.monotonic() - began, 1)
    if done.returncode != 0:
        return {"status": "failed", "seconds": seconds, "why": (done.stderr or done.stdout).strip()[-600:]}
    try:
        result = json.loads(done.stdout[done.stdout.index("{"):])
    except ValueError:
        return {"status": "failed", "seconds": seconds, "why": "no JSON in its output: " + done.stdout[-300:]}
    return {"status": "ok", "seconds": seconds, "result": result}


def tokens_per_s(result: dict) -> float | None:
    """The row's headline rate: training tokens/s, or the server's rate."""
    if "tokens_per_s" in result:
        return result["tokens_per_s"]
    rows = result.get("rows") or []
    return rows[-1].get("tokens_per_s") if rows else None


def summary(row: Row, results: dict[str, dict]) -> str:
    got = results[row.name]
    if got["status"] != "ok":
        return f"{got['status']}: {got.get('why', '').strip().splitlines()[-1:] or ''}"
    result = got["result"]
    if "engine" in result:  # bench_generate: the static path per batch, as % of the bandwidth limit
        return "; ".join(f"batch {r['batch']}: {r['static_tokens_per_s']:.0f} tok/s "
                         f"({100 * r['static_bandwidth_fraction']:.0f}% BW, {r['static_speedup']:.2f}x HF, "
                         f"same tokens {r['same_tokens']})" + kernel_summary(r.get("decode_kernels"))
                         for r in result["engine"])
    if "rollout_of_engine_alone" in result:  # bench_rl_gpu: a GRPO step's phases
        return (f"step {result['step_s']:.2f} s (rollout {result['rollout_s']:.2f}, logprobs {result['logprobs_s']:.2f}, "
                f"update {result['update_s']:.2f}, refresh {result['refresh_s']:.2f}); rollout "
                f"{result['rollout_tokens_per_s']:.0f} tok/s = {result['rollout_of_engine_alone']:.2f}x the engine "
                f"alone; peak {result['peak_memory_gb'] or 0:.1f} GB")
    if "optimizers" in result:  # bench_optimizers: step time and the optimizer step's share of it
        return "; ".join(f"{r['optimizer']}: step {r['step_ms']:.0f} ms, optimizer {r['optimizer_step_ms']:.1f} ms "
                         f"({r['optimizer_share']:.1%}), loss {r['losses'][-1]:.3f}" for r in result["optimizers"])
    if "quantization" in result:  # bench_quantization: each kind against the baseline dtype
        return "; ".join(f"{r['dtype'] if r['quantization'] == 'none' else r['quantization']}: " + ", ".join(f"batch {b['batch']} {b['tokens_per_s']:.0f} tok/s "
                                                               f"({b['speedup']:.2f}x)" for b in r["batches"])
                         + f", weights {r['weight_bytes'] / 2**30:.2f} GiB" for r in result["quantization"])
    if "rows" in result:  # bench_serve
        return "; ".join(f"{r.get('clients')} clients: {r['tokens_per_s']:.0f} tok/s"
                         + (f" ({r['of_engine']:.2f}x the engine)" if "of_engine" in r else "")
                         for r in result["rows"])
    text = f"{result['tokens_per_s'] / 1e3:.1f}k tok/s"
    base = results.get(row.baseline or "", {})
    if base.get("status") == "ok" and tokens_per_s(base["result"]):
        text += f" ({result['tokens_per_s'] / tokens_per_s(base['result']):.2f}x {row.baseline})"
    if result.get("mfu"):
        text += f", MFU {result['mfu']:.1%}"
    if result.get("peak_memory_gb"):
        text += f", peak {result['peak_memory_gb']:.1f} GB"
    return text + kernel_summary(result.get("kernels"))


def kernel_summary(kernels: dict | None) -> str:
    """A profiled row's launches per step and its three costliest kernel categories."""
    if not kernels:
        return ""
    top = sorted(kernels["by_category"].items(), key=lambda kv: -kv[1]["ms"])[:3]
    return (f"; {kernels['calls_per_step']:.0f} kernels/step, {kernels['ms_per_step']:.2f} ms: "
            + ", ".join(f"{name} {entry['ms']:.2f} ms" for name, entry in top))


def markdown(header: dict, rows: list[Row], results: dict[str, dict]) -> str:
    lines = [f"GPU suite: {header['device']}, torch {header['torch']}, commit {header['commit']}, {header['date']}",
             "", "| row | result | target | seconds | command |", "|---|---|---|---|---|"]
    for row in rows:
        if row.name in results:
            got = results[row.name]
            lines.append(f"| {row.name} | {summary(row, results)} | {row.target} | {got.get('seconds', '')} | "
                         f"`python benchmarks/{' '.join(row.argv)}` |")
    return "\n".join(lines) + "\n"


def machine_header() -> dict:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"no GPU ({platform.processor()})"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    return {"device": device, "torch": torch.__version__, "commit": commit.stdout.strip() or "unknown",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def check_scripts(argv: list[str]) -> int:
    """``--check-script SCRIPT CHECKS`` pairs: each script's checks (:func:`check_script`), the
    failures named on stderr; non-zero if any failed."""
    failed = 0
    for script, checks in zip(argv[1::3], argv[2::3], strict=True):
        try:
            check_script(script, json.loads(checks))
        except (Exception, SystemExit) as error:
            failed += 1
            print(f"{script}: the check failed: {error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check-script"]:
        sys.exit(check_scripts(sys.argv[1:]))
    sys.exit(main())
