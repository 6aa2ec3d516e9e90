"""Whether ``mega train`` compiles its layers: ``--compile`` / ``--no-compile``, else by default
with FP8 on a GPU (torchao's FP8 is slower than bf16 eager), but not under selective recompute
(which ``--compile`` refuses). Decided from the run's config and the device alone (CPU test)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mega.train.compile import compiles


def run(compile=None, fp8=None, recompute=None):
    return SimpleNamespace(kernels=SimpleNamespace(compile=compile), precision=SimpleNamespace(fp8=fp8),
                           model=SimpleNamespace(recompute_granularity=recompute))


@pytest.mark.parametrize(("config", "device", "expected"), [
    (run(), "cuda", False),  # bf16 stays eager unless asked
    (run(fp8="hybrid"), "cuda", True),  # FP8 on a GPU compiles by default
    (run(fp8="hybrid"), "cpu", False),  # not on the CPU (tests, small runs)
    (run(fp8="e4m3", recompute="selective"), "cuda", False),  # --compile refuses selective recompute
    (run(compile=False, fp8="hybrid"), "cuda", False),  # --no-compile
    (run(compile=True), "cpu", True),  # --compile
])
def test_compile_default(config, device, expected):  # device: cpu (the GPU case is only named)
    assert compiles(config, torch.device(device)) is expected
