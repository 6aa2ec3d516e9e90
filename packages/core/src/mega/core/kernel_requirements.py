"""What a kernel backend needs of this machine, said the way ``is_available`` must say it.

A backend's ``is_available()`` returns ``(False, what is missing)``; the text names the package
and version to install, or the GPU it needs. These helpers write those sentences once for
every backend plugin. The package is asked first and the GPU only when the package is there,
so on a machine without the library nothing touches CUDA.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from typing import Protocol

from mega.core.plugins.install_hint import pip_install


def version_tuple(version: str) -> tuple[int, ...]:
    """``"2.7.4.post1"`` -> ``(2, 7, 4)``: the leading release numbers, enough to compare."""
    numbers = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in numbers.group(0).split(".")) if numbers else ()


def installed_version(module, distribution: str) -> str | None:
    """The version of an imported ``module``: its ``__version__``, else its distribution's."""
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_problem(module: str, distribution: str, minimum: str | None = None, install: str | None = None) -> str:
    """"" when ``module`` imports (at ``minimum`` or newer), else what is missing: the
    distribution, the version needed, and how to install it."""
    needed = f"{distribution} >= {minimum}" if minimum else distribution
    how = install or pip_install(f"'{needed}'")
    try:
        imported = importlib.import_module(module)
    except ImportError as error:
        missing = error.name or module
        if missing == module or module.startswith(f"{missing}."):
            return f"{needed} is not installed ({how})"
        if not missing.startswith(module.split(".")[0]):  # a dependency of the package
            return f"{needed} needs {missing}, which is not installed ({how})"
        return f"{needed} is installed but does not import ({error}); reinstall it ({how})"
    if minimum:
        version = installed_version(imported, distribution)
        if version is None or version_tuple(version) < version_tuple(minimum):
            return f"{needed} is needed, {distribution} {version or '(unknown version)'} is installed ({how})"
    return ""


class GPU(Protocol):
    def problem(self, minimum_capability: tuple[int, int]) -> str:
        """"" when a CUDA GPU of at least ``minimum_capability`` is here, else what is missing."""

    def capability(self) -> tuple[int, int] | None:
        """The current device's compute capability, None without a CUDA GPU."""


class CudaGPU:
    """The current CUDA device, asked through torch (imported only when asked)."""

    def capability(self) -> tuple[int, int] | None:
        import torch  # start-up cost: plugins import this module when they register

        if not torch.cuda.is_available():
            return None
        return tuple(torch.cuda.get_device_capability())

    def problem(self, minimum_capability: tuple[int, int]) -> str:
        capability = self.capability()
        wanted = ".".join(map(str, minimum_capability))
        if capability is None:
            return f"a CUDA GPU of compute capability >= {wanted} (torch sees no CUDA device)"
        if capability < minimum_capability:
            import torch  # start-up cost, as above

            return (f"a CUDA GPU of compute capability >= {wanted} (this {torch.cuda.get_device_name()} "
                    f"is {'.'.join(map(str, capability))})")
        return ""


def first_problem(*checks) -> tuple[bool, str]:
    """``is_available``'s answer from checks run in order (callables returning "" when met):
    the first unmet one, so a missing package is reported before the GPU is asked about."""
    for check in checks:
        problem = check()
        if problem:
            return False, problem
    return True, ""


class FixedGPU:
    """A GPU probe that reports a device of ``capability`` without asking CUDA. For tests only:
    they run a backend's adapters against a stand-in library on the CPU (the GPU requirement
    bypassed explicitly, never by an environment variable)."""

    def __init__(self, capability: tuple[int, int] = (8, 0)):
        self._capability = capability

    def capability(self) -> tuple[int, int]:
        return self._capability

    def problem(self, minimum_capability: tuple[int, int]) -> str:
        if self._capability >= minimum_capability:
            return ""
        return (f"a CUDA GPU of compute capability >= {'.'.join(map(str, minimum_capability))} "
                f"(this one is {'.'.join(map(str, self._capability))})")
