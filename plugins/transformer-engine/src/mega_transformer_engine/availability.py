"""What this machine lacks for Transformer Engine: the package (and its version), a CUDA GPU, and
for FP8 a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from dataclasses import dataclass

# Megatron-Core 0.16's TE spec (LayerNormLinear with RMSNorm, DotProductAttention with GQA and
# bottom-right causal masks) needs this release or newer.
MIN_VERSION = (1, 13)
FP8_MIN_CAPABILITY = (8, 9)
PACKAGE = "transformer-engine"


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


@dataclass(frozen=True)
class Environment:
    """What was found: TE's version (None: not importable), a CUDA GPU, its compute capability."""

    te_version: str | None
    cuda: bool
    capability: tuple[int, int] | None

    @classmethod
    def probe(cls) -> Environment:
        version = None
        if _importable("transformer_engine"):
            try:
                version = importlib.metadata.version(PACKAGE)
            except importlib.metadata.PackageNotFoundError:
                # optional dependency: the kernel library may be absent; the backend reports it
                import transformer_engine

                version = getattr(transformer_engine, "__version__", "0")
        # optional dependency, as above
        import torch

        cuda = torch.cuda.is_available()
        return cls(version, cuda, torch.cuda.get_device_capability() if cuda else None)

    def missing(self, fp8: bool = False) -> str:
        """What is missing, in words ("" when nothing is)."""
        wanted = ".".join(map(str, MIN_VERSION))
        problems = []
        if self.te_version is None:
            problems.append(f"{PACKAGE} >= {wanted} is not installed (pip install -c constraints.txt {PACKAGE}[pytorch], "
                            "or an NGC PyTorch container)")
        elif _version_tuple(self.te_version) < MIN_VERSION:
            problems.append(f"{PACKAGE} {self.te_version} is installed, >= {wanted} is needed")
        if not self.cuda:
            problems.append("no CUDA GPU is visible")
        elif fp8 and self.capability is not None and tuple(self.capability) < FP8_MIN_CAPABILITY:
            have, need = ".".join(map(str, self.capability)), ".".join(map(str, FP8_MIN_CAPABILITY))
            problems.append(f"FP8 needs a GPU of compute capability >= {need} (Ada/Hopper), this one is {have}")
        return "; ".join(problems)


def _importable(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None
