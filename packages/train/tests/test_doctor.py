"""`mega doctor`: its checks on this machine, and its reading of nvidia-smi from real-format output.

The two ``nvidia-smi topo -m`` fixtures follow the command's documented format (tab-separated
matrix, NIC columns, affinities, legend; the DGX one with the underline escape codes newer
drivers print): a DGX H100 (8 GPUs, NV18 to every other GPU through NVSwitch) and an 8-GPU PCIe
server (pairs on one switch: PIX; two switches under one root: PXB; across sockets: SYS).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from mega.train.doctor import checks
from mega.train.doctor.command import main as doctor_main
from mega.train.doctor.topology import (
    Topology,
    TopologyError,
    advise,
    largest_fast_group,
    parse_topology,
)

FIXTURES = Path(__file__).parent / "fixtures" / "nvidia-smi"
SMI_HEADER = """Mon Nov 23 14:00:00 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
"""


def test_nvlink_box_puts_any_group_on_nvlink():
    topology = parse_topology((FIXTURES / "topo-dgx-h100.txt").read_text())
    assert topology.num_gpus == 8 and topology.all_nvlink
    advice = {a.size: a for a in advise(topology)}
    assert advice[8].groups == [list(range(8))] and advice[8].worst_link == "NV18"
    assert advice[2].groups == [[0, 1], [2, 3], [4, 5], [6, 7]] and advice[2].visible_devices is None
    assert largest_fast_group(list(advice.values())) == 8


def test_pcie_box_keeps_tensor_parallel_inside_a_socket():
    topology = parse_topology((FIXTURES / "topo-pcie-8gpu.txt").read_text())
    assert not topology.all_nvlink
    advice = {a.size: a for a in advise(topology)}
    assert (advice[2].groups, advice[2].worst_link) == ([[0, 1], [2, 3], [4, 5], [6, 7]], "PIX")
    assert (advice[4].groups, advice[4].worst_link) == ([[0, 1, 2, 3], [4, 5, 6, 7]], "PXB")
    assert advice[8].worst_link == "SYS"
    assert largest_fast_group(list(advice.values())) == 4


def test_a_numbering_that_splits_switches_gets_a_device_order():
    # The PCIe box with its GPUs numbered alternately across the two sockets.
    pcie = parse_topology((FIXTURES / "topo-pcie-8gpu.txt").read_text())
    physical = [0, 4, 1, 5, 2, 6, 3, 7]  # GPU i here is physical GPU physical[i]
    links = tuple(tuple(pcie.links[physical[a]][physical[b]] for b in range(8)) for a in range(8))
    advice = {a.size: a for a in advise(Topology(links))}
    assert advice[2].groups == [[0, 2], [1, 3], [4, 6], [5, 7]] and advice[2].worst_link == "PIX"
    assert advice[2].visible_devices == "0,2,1,3,4,6,5,7"
    assert advice[4].groups == [[0, 2, 4, 6], [1, 3, 5, 7]] and advice[4].worst_link == "PXB"


def test_malformed_topology_names_the_line():
    text = (FIXTURES / "topo-pcie-8gpu.txt").read_text()
    with pytest.raises(TopologyError, match="line 5 of nvidia-smi topo -m output has 3 links, expected 8"):
        parse_topology(_truncate_row(text, 3))
    with pytest.raises(TopologyError, match="unknown link 'QQQ'"):
        parse_topology(text.replace("PIX", "QQQ", 1))


def _truncate_row(text: str, gpu: int) -> str:
    lines = text.splitlines()
    lines[gpu + 1] = "\t".join(lines[gpu + 1].split("\t")[:4])
    return "\n".join(lines)


@pytest.mark.parametrize(("runtime", "status"), [("12.1", "pass"), ("12.8", "warn"), ("13.0", "fail")])
def test_driver_and_cuda_runtime_compatibility(fake_smi, runtime, status):
    fake_smi("topo-dgx-h100.txt")
    check = checks.check_driver(SimpleNamespace(version=SimpleNamespace(cuda=runtime)))
    assert check.status == status, check
    assert "driver 550.54.15, supports CUDA up to 12.4" in check.detail


def test_doctor_on_this_machine_lists_every_check_and_passes(capsys):
    assert doctor_main([]) == 0
    out = capsys.readouterr().out
    for name in ("python", "torch", "driver", "cudnn", "nccl", "gpus", "topology", "packages", "plugins",
                 "kernel backends", "env CUDA_DEVICE_MAX_CONNECTIONS", "env NCCL_SOCKET_IFNAME", "env OMP_NUM_THREADS"):
        assert f"  {name} " in out, name
    assert "mega-core" in out and "torch (activation,attention,block_attention,linear,loss,norm,rotary): available" in out
    assert doctor_main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and {c["status"] for c in report["checks"]} <= {"pass", "warn", "skip"}


def test_doctor_reads_a_pcie_box_through_nvidia_smi(fake_smi, capsys):
    fake_smi("topo-pcie-8gpu.txt")
    assert doctor_main(["--json"]) == 0
    topology = json.loads(capsys.readouterr().out)["facts"]["topology"]
    assert topology["largest_fast_tensor_parallel"] == 4
    doctor_main([])
    out = capsys.readouterr().out
    assert "WARN  topology" in out and "--tensor-model-parallel-size <= 4" in out
    assert "tp=2: groups [0,1] [2,3] [4,5] [6,7], slowest link inside PIX (one PCIe bridge)" in out


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """Put an ``nvidia-smi`` on PATH answering like a driver 550 machine with the given topology."""
    def install(fixture: str) -> None:
        script = tmp_path / "nvidia-smi"
        (tmp_path / "header.txt").write_text(SMI_HEADER)
        script.write_text(
            "#!/bin/sh\n"
            f'case "$1" in\n  topo) cat "{FIXTURES / fixture}" ;;\n'
            '  --query-gpu=driver_version) for i in 0 1 2 3 4 5 6 7; do echo 550.54.15; done ;;\n'
            f'  *) cat "{tmp_path / "header.txt"}" ;;\nesac\n')
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return install


class _Distribution:
    """A stand-in installed distribution: its name and its declared requirements (CPU only)."""

    def __init__(self, name, requires):
        self.metadata, self.requires = {"Name": name}, requires


def test_doctor_reports_a_dependency_outside_the_declared_range():
    import torch

    torch_version = torch.__version__.split("+")[0]
    met = _Distribution("mega-example", [f"torch>={torch_version}", "numpy>=1.0; extra == 'test'"])
    assert checks.version_mismatches([met]) == []  # an extra's requirement is not the distribution's own
    too_new = _Distribution("mega-example", [f"torch<{torch_version}", "surely-not-installed-package>=1"])
    assert checks.version_mismatches([too_new]) == [
        f"mega-example needs torch<{torch_version}; {torch.__version__} is installed",
        "mega-example needs surely-not-installed-package>=1; it is not installed"]
    check = checks.check_dependency_versions([too_new])
    assert check.status == "warn" and "torch<" in check.detail
    # What is installed here meets every declared range (mega-torchao's torchao window included).
    assert checks.check_dependency_versions().status == "pass"
    assert "mega-torchao" in {d.metadata["Name"] for d in checks.mega_distributions()}
