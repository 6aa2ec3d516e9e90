"""The kernel tables of the GPU rows (benchmarks/kernel_profile.py), checked on the CPU.

Device: CPU only (the profiler's CPU operators stand in for CUDA kernels; the GPU rows of
``gpu_suite.py`` use the same code with kernels). What is checked: a step's operators are
counted exactly, the difference of two runs isolates the steps between them, and
``bench_generate.py --profile`` gives the decode step's matrix multiplies: four per LLaMA layer
(fused QKV, output, fused gate/up, down) plus the output head, with the prefill cancelled out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from kernel_profile import category, difference, markdown, profile_steps  # noqa: E402


def _calls(rows, name: str) -> float:
    return next((row.calls_per_step for row in rows if row.name == name), 0.0)


def test_a_step_is_counted_exactly_and_a_difference_isolates_the_extra_steps():
    weight = torch.randn(16, 16)

    def matmuls(count: int):
        def step():
            x = torch.ones(4, 16)
            for _ in range(count):
                x = torch.mm(x, weight)
            return x.relu()
        return step

    rows = profile_steps(matmuls(3), steps=2, on_gpu=False)
    assert _calls(rows, "aten::mm") == 3 and _calls(rows, "aten::relu") == 1
    assert category("aten::mm") == "gemm" and category("aten::_scaled_mm") == "fp8 gemm"
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"

    longer = profile_steps(matmuls(7), steps=1, on_gpu=False)
    shorter = profile_steps(matmuls(2), steps=1, on_gpu=False)
    extra = difference(longer, shorter, extra_steps=5)
    assert _calls(extra, "aten::mm") == 1
    assert _calls(extra, "aten::relu") == 0  # once in each run: cancelled
    assert "aten::mm" in markdown(extra)


def test_bench_generate_profiles_the_decode_step_of_the_static_path():
    argv = [sys.executable, str(ROOT / "benchmarks" / "bench_generate.py"), "--family", "llama", "--layers", "2",
            "--hidden", "64", "--heads", "4", "--vocab", "256", "--prompt", "8", "--new-tokens", "6",
            "--batches", "1", "--repeats", "1", "--warmup", "1", "--no-server", "--profile", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout[done.stdout.index("{"):])["engine"][0]
    assert row["same_tokens"]
    kernels = row["decode_kernels"]
    per_step = {entry["name"]: entry["calls_per_step"] for entry in kernels["top"]}
    assert per_step["aten::mm"] == 2 * 4 + 1  # per layer: QKV, output, gate/up, down; then the head
    assert kernels["by_category"]["gemm"]["calls"] >= 9
