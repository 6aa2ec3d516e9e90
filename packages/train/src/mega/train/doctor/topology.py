"""Read ``nvidia-smi topo -m`` and advise which GPUs to put in one tensor-parallel group.

The matrix gives, for each pair of GPUs, the best path between them (NVIDIA's legend):

    NV#   a bonded set of # NVLinks          PIX   at most one PCIe bridge
    PXB   several PCIe bridges               PHB   a PCIe host bridge (the CPU)
    NODE  host bridges within a NUMA node    SYS   the inter-socket link (QPI/UPI)

Tensor parallelism all-reduces activations twice per layer, so its group wants the fastest links.
mega orders ranks tp-cp-ep-dp-pp with tp fastest (as Megatron), so the tensor-parallel groups are
consecutive local ranks, i.e. consecutive devices of ``CUDA_VISIBLE_DEVICES``; the advice names
groups and, when the devices' own numbering splits a good group, the order to list them in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Path kinds from best to worst; NVLink ranks above all of them, more links above fewer.
PCIE_RANK = {"PIX": 4, "PXB": 3, "PHB": 2, "NODE": 1, "SYS": 0, "SOC": 0}
PATH_MEANING = {
    "PIX": "one PCIe bridge", "PXB": "several PCIe bridges", "PHB": "a PCIe host bridge",
    "NODE": "PCIe host bridges within a NUMA node", "SYS": "the link between CPU sockets",
    "SOC": "the link between CPU sockets",
}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GPU = re.compile(r"^GPU(\d+)$")


class TopologyError(ValueError):
    """Output that is not the matrix of ``nvidia-smi topo -m``."""


def link_rank(path: str) -> int:
    """Higher is faster: NV18 > NV4 > PIX > PXB > PHB > NODE > SYS."""
    if path.startswith("NV") and path[2:].isdigit():
        return 100 + int(path[2:])
    if path in PCIE_RANK:
        return PCIE_RANK[path]
    raise TopologyError(f"unknown link {path!r} in nvidia-smi topo -m output")


def describe(path: str) -> str:
    if path.startswith("NV"):
        return f"{path} ({path[2:]} bonded NVLinks)"
    return f"{path} ({PATH_MEANING[path]})"


@dataclass(frozen=True)
class Topology:
    """``links[i][j]``: the path between GPU i and GPU j (``"X"`` on the diagonal)."""

    links: tuple[tuple[str, ...], ...]

    @property
    def num_gpus(self) -> int:
        return len(self.links)

    def worst_link(self, gpus: list[int]) -> str:
        pairs = [self.links[a][b] for a in gpus for b in gpus if a < b]
        return min(pairs, key=link_rank) if pairs else "X"

    @property
    def all_nvlink(self) -> bool:
        return self.num_gpus > 1 and self.worst_link(list(range(self.num_gpus))).startswith("NV")


def parse_topology(text: str) -> Topology:
    """The GPU-to-GPU part of ``nvidia-smi topo -m`` (NIC columns and affinities are ignored)."""
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header_index = next((i for i, line in enumerate(lines) if line.split()[:1] == ["GPU0"]), None)
    if header_index is None:
        raise TopologyError("no header row starting with GPU0 in nvidia-smi topo -m output")
    columns = lines[header_index].split()
    num_gpus = 0
    while num_gpus < len(columns) and columns[num_gpus] == f"GPU{num_gpus}":
        num_gpus += 1
    rows: dict[int, tuple[str, ...]] = {}
    for number, line in enumerate(lines[header_index + 1:], start=header_index + 2):
        cells = line.split()
        match = _GPU.match(cells[0]) if cells else None
        if match is None:
            continue
        if len(cells) < num_gpus + 1:
            raise TopologyError(f"line {number} of nvidia-smi topo -m output has {len(cells) - 1} links, "
                                f"expected {num_gpus}: {line.strip()!r}")
        links = tuple(cells[1:num_gpus + 1])
        for other, path in enumerate(links):
            if other != int(match.group(1)):
                link_rank(path)  # rejects what is not a link
        rows[int(match.group(1))] = links
    if sorted(rows) != list(range(num_gpus)):
        raise TopologyError(f"nvidia-smi topo -m output names {num_gpus} GPU columns but rows for GPUs {sorted(rows)}")
    return Topology(tuple(rows[i] for i in range(num_gpus)))


def tensor_parallel_groups(topology: Topology, size: int) -> list[list[int]]:
    """Split the GPUs into groups of ``size`` whose slowest internal link is as fast as possible.

    Greedy: each group starts at the lowest free GPU and adds the free GPU whose slowest link to
    the group is best (the lowest number on a tie). Servers are built as trees of switches, for
    which this finds the islands exactly.
    """
    if size < 1 or topology.num_gpus % size:
        raise ValueError(f"tensor-parallel size {size} does not divide the {topology.num_gpus} GPUs")
    free = list(range(topology.num_gpus))
    groups = []
    while free:
        group = [free.pop(0)]
        while len(group) < size:
            best = max(free, key=lambda gpu: (min(link_rank(topology.links[gpu][m]) for m in group), -gpu))
            free.remove(best)
            group.append(best)
        groups.append(sorted(group))
    return groups


@dataclass(frozen=True)
class GroupAdvice:
    size: int
    groups: list[list[int]]
    worst_link: str  # the slowest link inside the best groups
    visible_devices: str | None  # a CUDA_VISIBLE_DEVICES order making them consecutive ranks, if needed

    def as_text(self) -> str:
        groups = " ".join("[" + ",".join(str(g) for g in group) + "]" for group in self.groups)
        text = f"tp={self.size}: groups {groups}, slowest link inside {describe(self.worst_link)}"
        if self.visible_devices:
            text += f"; list them as CUDA_VISIBLE_DEVICES={self.visible_devices} so each group is consecutive ranks"
        return text


def advise(topology: Topology) -> list[GroupAdvice]:
    """The best tensor-parallel groups for every power-of-two size up to the number of GPUs."""
    advice, size = [], 2
    while size <= topology.num_gpus:
        if topology.num_gpus % size == 0:
            groups = tensor_parallel_groups(topology, size)
            worst = min((topology.worst_link(g) for g in groups), key=link_rank)
            order = [gpu for group in groups for gpu in group]
            consecutive = order == list(range(topology.num_gpus))
            advice.append(GroupAdvice(size, groups, worst, None if consecutive else ",".join(map(str, order))))
        size *= 2
    return advice


def largest_fast_group(advice: list[GroupAdvice]) -> int:
    """The largest tp whose groups stay on NVLink, else on one PCIe switch (PIX/PXB); 1 if none."""
    for fast in (lambda path: path.startswith("NV"), lambda path: link_rank(path) >= PCIE_RANK["PXB"]):
        sizes = [a.size for a in advice if fast(a.worst_link)]
        if sizes:
            return max(sizes)
    return 1
