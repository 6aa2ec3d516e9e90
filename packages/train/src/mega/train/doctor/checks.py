"""The checks of `mega doctor`, each a :class:`Check` with pass / warn / fail / skip.

``skip`` is for what does not apply here (GPU checks on a CPU-only machine); only ``fail`` makes
`mega doctor` exit non-zero. GPU facts come from torch and from ``nvidia-smi`` (driver version,
the CUDA version the driver supports, ``topo -m``), run through :func:`run_tool` so tests can
put a fake ``nvidia-smi`` on ``PATH``.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from packaging.requirements import InvalidRequirement, Requirement

from mega.core.plugins import get_plugins
from mega.train.doctor.topology import TopologyError, advise, largest_fast_group, parse_topology

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"
MIN_PYTHON = (3, 10)
BF16_COMPUTE_CAPABILITY = (8, 0)  # Ampere: bf16 tensor cores, FlashAttention-2


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    advice: str = ""


def run_tool(*argv: str, timeout_s: float = 20.0) -> str | None:
    """The standard output of a command, or None if it is missing or fails."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def check_python() -> Check:
    version = platform.python_version()
    if sys.version_info[:2] >= MIN_PYTHON:
        return Check("python", PASS, f"Python {version} ({sys.executable})")
    return Check("python", FAIL, f"Python {version}", f"mega needs Python >= {'.'.join(map(str, MIN_PYTHON))}")


def check_torch(torch) -> Check:
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    return Check("torch", PASS, f"torch {torch.__version__} ({build})")


def check_gpus(torch) -> tuple[Check, list[dict]]:
    if not torch.version.cuda:
        return Check("gpus", SKIP, "no GPU support in this torch build: training runs on the CPU (gloo)"), []
    if not torch.cuda.is_available():
        return Check("gpus", FAIL, f"torch was built for CUDA {torch.version.cuda} but sees no GPU",
                     "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"), []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name, "memory_gib": round(props.total_memory / 1024**3, 1),
                     "compute_capability": f"{props.major}.{props.minor}"})
    old = [g for g in gpus if _version_tuple(g["compute_capability"]) < BF16_COMPUTE_CAPABILITY]
    detail = "; ".join(f"{g['index']}: {g['name']} {g['memory_gib']} GiB sm_{g['compute_capability']}" for g in gpus)
    if old:
        return Check("gpus", WARN, detail, "compute capability below 8.0: no bf16 tensor cores or flash attention"), gpus
    return Check("gpus", PASS, detail), gpus


def driver_cuda_version(smi_output: str | None) -> str | None:
    """The highest CUDA version the driver supports, from the header of plain ``nvidia-smi``."""
    match = re.search(r"CUDA Version:\s*([\d.]+)", smi_output or "")
    return match.group(1) if match else None


def check_driver(torch) -> Check:
    versions = run_tool("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
    if versions is None:
        status = SKIP if not torch.version.cuda else WARN
        return Check("driver", status, "nvidia-smi not found: no NVIDIA driver here")
    driver = versions.split()[0] if versions.split() else "?"
    supports = driver_cuda_version(run_tool("nvidia-smi"))
    runtime = torch.version.cuda
    detail = f"driver {driver}, supports CUDA up to {supports or '?'}; torch's CUDA runtime {runtime or 'none'}"
    if not runtime or not supports:
        return Check("driver", PASS if not runtime else WARN, detail)
    if _version_tuple(supports)[0] < _version_tuple(runtime)[0]:
        return Check("driver", FAIL, detail, f"the driver is too old for CUDA {runtime}: update the driver "
                     "or install a torch built for an older CUDA")
    if _version_tuple(supports) < _version_tuple(runtime):
        return Check("driver", WARN, detail, "minor-version compatibility only: kernels JIT-compiled from PTX "
                     "may fail; a newer driver is safer")
    return Check("driver", PASS, detail)


def check_cudnn_nccl(torch) -> list[Check]:
    if not torch.version.cuda:
        return [Check("cudnn", SKIP, "CPU-only torch"), Check("nccl", SKIP, "CPU-only torch: gloo does the collectives")]
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    checks = [Check("cudnn", PASS if cudnn else WARN, f"cuDNN {cudnn}" if cudnn else "cuDNN not available")]
    if dist.is_available() and dist.is_nccl_available():
        version = ".".join(map(str, torch.cuda.nccl.version()))
        checks.append(Check("nccl", PASS, f"NCCL {version}"))
    else:
        checks.append(Check("nccl", FAIL, "torch has no NCCL backend", "multi-GPU training needs NCCL"))
    return checks


def check_topology() -> tuple[Check, dict]:
    text = run_tool("nvidia-smi", "topo", "-m")
    if text is None:
        return Check("topology", SKIP, "nvidia-smi topo -m not available"), {}
    try:
        topology = parse_topology(text)
    except TopologyError as error:
        return Check("topology", WARN, f"could not read nvidia-smi topo -m: {error}"), {}
    if topology.num_gpus < 2:
        return Check("topology", SKIP, "one GPU: no tensor-parallel group to place"), {}
    advice = advise(topology)
    fast = largest_fast_group(advice)
    lines = [a.as_text() for a in advice]
    facts = {"gpus": topology.num_gpus, "all_nvlink": topology.all_nvlink, "links": [list(r) for r in topology.links],
             "tensor_parallel": [{"size": a.size, "groups": a.groups, "worst_link": a.worst_link,
                                  "cuda_visible_devices": a.visible_devices} for a in advice],
             "largest_fast_tensor_parallel": fast}
    if topology.all_nvlink:
        summary = f"all {topology.num_gpus} GPUs are NVLink peers: any tensor-parallel group up to {topology.num_gpus} stays on NVLink"
        return Check("topology", PASS, summary + "\n" + "\n".join(lines)), facts
    summary = (f"not all GPUs are NVLink peers: keep --tensor-model-parallel-size <= {fast} "
               "(larger groups cross slower links)")
    return Check("topology", WARN, summary + "\n" + "\n".join(lines),
                 "use pipeline or data parallelism across the slower links"), facts


def check_packages() -> tuple[Check, dict]:
    found = {}
    for dist_ in importlib.metadata.distributions():
        name = dist_.metadata["Name"] or ""
        if name.lower().startswith("mega-") or name.lower() == "mega":
            found[name] = dist_.version
    detail = ", ".join(f"{name} {version}" for name, version in sorted(found.items())) or "none"
    return Check("packages", PASS if found else WARN, detail), found


def mega_distributions() -> list[importlib.metadata.Distribution]:
    """The installed distributions that register with mega (its packages and every plugin)."""
    found = {}
    for distribution in importlib.metadata.distributions():
        if any(entry.group == "mega" for entry in distribution.entry_points):
            found[distribution.metadata["Name"]] = distribution
    return [found[name] for name in sorted(found)]


def version_mismatches(distributions) -> list[str]:
    """Each requirement of ``distributions`` (their own, not their extras') that the installed
    version of the required package does not meet, as "DIST needs REQ; VERSION is installed"."""
    lines = []
    for distribution in distributions:
        for text in distribution.requires or []:
            try:
                requirement = Requirement(text)
            except InvalidRequirement:
                continue
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue  # an extra's requirement, or one for another platform
            try:
                installed = importlib.metadata.version(requirement.name)
            except importlib.metadata.PackageNotFoundError:
                lines.append(f"{distribution.metadata['Name']} needs {requirement}; it is not installed")
                continue
            if requirement.specifier and not requirement.specifier.contains(installed, prereleases=True):
                lines.append(f"{distribution.metadata['Name']} needs {requirement}; {installed} is installed")
    return lines


def check_dependency_versions(distributions=None) -> Check:
    """The versions mega's distributions declare working (mega-torchao's torchao range, say)
    against what is installed: a mismatch is a warning naming both, since a package installed
    past the resolver (or a newer torch) may import and still misbehave."""
    mismatches = version_mismatches(mega_distributions() if distributions is None else distributions)
    if not mismatches:
        return Check("dependency versions", PASS, "every mega distribution's requirements are met")
    return Check("dependency versions", WARN, "\n".join(mismatches),
                 "install the versions named (pip install -c constraints.txt ...), or the plugin's newer release")


def check_plugins() -> list[Check]:
    plugins = get_plugins()
    checks = []
    failed = plugins.failed()
    if failed:
        checks.append(Check("plugins", FAIL, "; ".join(f"{i.name} ({i.distribution}): {i.error}" for i in failed),
                            "reinstall the named distribution (pip install -c constraints.txt ..., as the README "
                            "installs) or disable it with MEGA_DISABLE_PLUGINS; MEGA_PLUGIN_TRACEBACKS=1 shows why"))
    else:
        checks.append(Check("plugins", PASS, f"{len(plugins.infos)} loaded: " + ", ".join(i.name for i in plugins.infos)))
    for info in plugins.contested():
        # The newcomer is the one to disable: the name worked before it was installed.
        checks.append(Check("plugin names", FAIL, "; ".join(info.duplicates),
                            f"disable the newcomer: MEGA_DISABLE_PLUGINS={info.name} "
                            f"(or pip uninstall {info.distribution})"))
    backends = []
    for name in plugins.kernel_backends.names():
        try:
            backend = plugins.kernel_backends.get(name)
        except Exception as error:  # a broken or contested backend must not hide the others
            backends.append(f"{name}: ERROR {error}")
            continue
        available, missing = backend.is_available()
        kinds = ",".join(sorted(getattr(backend, "kinds", ()))) or "?"
        backends.append(f"{name} ({kinds}): " + ("available" if available else f"unavailable ({missing})"))
    checks.append(Check("kernel backends", PASS if backends else WARN, "; ".join(backends) or "none registered"))
    return checks


# Variables that change how training behaves, with what to check about each.
ENVIRONMENT = {
    "CUDA_VISIBLE_DEVICES": "which GPUs this process sees (and in which order: tp groups are consecutive)",
    "CUDA_DEVICE_MAX_CONNECTIONS": "Megatron sets 1 so communication kernels overlap compute in order",
    "NCCL_SOCKET_IFNAME": "the network interface NCCL bootstraps over (multi-node)",
    "NCCL_IB_HCA": "InfiniBand adapters NCCL uses",
    "NCCL_IB_DISABLE": "1 turns InfiniBand off (multi-node traffic then goes over TCP)",
    "NCCL_P2P_DISABLE": "1 turns GPU peer-to-peer (NVLink, PCIe) off",
    "NCCL_DEBUG": "INFO prints NCCL's topology and ring choices",
    "OMP_NUM_THREADS": "CPU threads per process (torchrun sets 1)",
    "PYTORCH_CUDA_ALLOC_CONF": "allocator settings (expandable_segments:True reduces fragmentation)",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "turns a hung collective into an error",
    "MASTER_ADDR": "rendezvous host for torchrun-less launches",
}


def check_environment(environ, has_gpus: bool, cpu_count: int) -> list[Check]:
    checks = []
    for name, meaning in ENVIRONMENT.items():
        value = environ.get(name)
        status, advice = PASS, ""
        if name in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE") and value == "1":
            status, advice = WARN, f"{name}=1 slows collectives; unset it unless a broken link needs it"
        elif name == "CUDA_DEVICE_MAX_CONNECTIONS" and has_gpus and value != "1":
            status, advice = WARN, "set CUDA_DEVICE_MAX_CONNECTIONS=1 for tensor/sequence-parallel overlap"
        elif name == "OMP_NUM_THREADS" and value and value.isdigit() and int(value) > cpu_count:
            status, advice = WARN, f"more threads than the {cpu_count} CPU cores"
        elif name == "NCCL_DEBUG" and value and value.upper() in ("INFO", "TRACE"):
            status, advice = WARN, f"NCCL_DEBUG={value} logs a lot; unset it for production runs"
        checks.append(Check(f"env {name}", status, f"{value if value is not None else '(unset)'}: {meaning}", advice))
    return checks


def run_checks(environ=None) -> tuple[list[Check], dict]:
    """Every check, and the facts behind them (for --json)."""
    environ = os.environ if environ is None else environ
    gpus_check, gpus = check_gpus(torch)
    checks = [check_python(), check_torch(torch), check_driver(torch), *check_cudnn_nccl(torch), gpus_check]
    topology_check, topology = check_topology()
    packages_check, packages = check_packages()
    checks += [topology_check, packages_check, check_dependency_versions(), *check_plugins(),
               *check_environment(environ, bool(gpus), os.cpu_count() or 1)]
    facts = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
             "cuda_runtime": torch.version.cuda, "gpus": gpus, "topology": topology, "packages": packages,
             "cpu_count": os.cpu_count()}
    return checks, facts
