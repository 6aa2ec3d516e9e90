"""What a kernel backend's ``is_available`` says is missing (mega.core.kernel_requirements)."""

from __future__ import annotations

import pytest

from mega.core.kernel_requirements import CudaGPU, FixedGPU, first_problem, package_problem, version_tuple


def test_versions_compare_by_their_release_numbers():
    assert version_tuple("2.7.4.post1") == (2, 7, 4)
    assert version_tuple("0.5.10") > version_tuple("0.5.3")
    assert version_tuple("2.8.0+cu128torch2.8") >= version_tuple("2.7")


def test_package_problem_names_the_distribution_version_and_dependency(tmp_path, monkeypatch):
    assert package_problem("json", "json") == ""
    assert package_problem("no_such_kernels", "no-such-kernels", "1.2") == (
        "no-such-kernels >= 1.2 is not installed (pip install -c constraints.txt 'no-such-kernels >= 1.2')")
    (tmp_path / "old_kernels.py").write_text("__version__ = '1.1.9'\n")
    (tmp_path / "needy_kernels.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert package_problem("old_kernels", "old-kernels", "1.2") == (
        "old-kernels >= 1.2 is needed, old-kernels 1.1.9 is installed (pip install -c constraints.txt 'old-kernels >= 1.2')")
    assert package_problem("needy_kernels", "needy-kernels", install="pip install needy-kernels triton") == (
        "needy-kernels needs no_such_dependency, which is not installed (pip install needy-kernels triton)")


def test_the_first_unmet_requirement_is_reported_and_the_gpu_asked_last():
    asked = []
    assert first_problem(lambda: "", lambda: "x is not installed", lambda: asked.append(1) or "") == (
        False, "x is not installed")
    assert asked == []
    assert first_problem(lambda: FixedGPU((9, 0)).problem((8, 0))) == (True, "")
    assert first_problem(lambda: FixedGPU((7, 5)).problem((8, 0))) == (
        False, "a CUDA GPU of compute capability >= 8.0 (this one is 7.5)")


def test_without_cuda_the_gpu_probe_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here")
    assert CudaGPU().capability() is None
    assert CudaGPU().problem((8, 0)) == "a CUDA GPU of compute capability >= 8.0 (torch sees no CUDA device)"
