"""Reading the pickles Megatron-LM writes (legacy ``model_optim_rng.pt``, torch_dist ``common.pt``)
without unpickling anything we did not list.

``torch.load(weights_only=True)`` already refuses every class but tensors and plain containers;
Megatron's files also hold a few objects of their own, allowed here by name and nothing else:

* ``argparse.Namespace`` and ``types.SimpleNamespace``: the run's arguments (``args``);
* ``pathlib.PosixPath`` and ``signal.Signals`` (``args.exit_signal``), as megatron-core's own
  allowlist (``megatron.core.safe_globals``) has them;
* Megatron's enums and small records (``args.model_type`` is a ``ModelType``, ``args.attention_backend``
  an ``AttnBackend``, the rerun state machine's ``RerunState``, ``OptimizerConfig``...): megatron is
  not a dependency, so each comes back as a :class:`MegatronObject` holding the class's name and
  the pickled values, and no megatron code runs;
* ``io.BytesIO``: Transformer Engine's ``_extra_state`` in older versions;
* numpy arrays: the numpy RNG state tuple in ``rng_state`` (Python's own RNG state is a tuple of
  ints, torch's a tensor).

Any other class or function in a file is refused before a byte is unpickled, naming it. The
allowlist is this module's alone: whatever other code registered with torch (megatron-core
registers its own list when imported) is set aside while a file is read.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import signal
import types
from pathlib import Path
from typing import Any

import torch

from mega.ckpt_convert.errors import ConversionError

# Megatron classes its checkpoints pickle (checked by name: megatron is not imported).
MEGATRON_CLASSES = frozenset({
    "megatron.core.enums.ModelType", "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope", "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig", "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode", "megatron.core.rerun_state_machine.RerunState",
})


class MegatronObject:
    """A Megatron enum member or record read from a pickle: the class's dotted name and the values
    it was pickled with (an enum's value, a record's fields); nothing of megatron runs."""

    class_name = ""

    def __init__(self, *args: Any):
        self.args, self.state = args, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def value(self) -> Any:
        return self.args[0] if len(self.args) == 1 else self.args

    def __repr__(self) -> str:
        return f"{self.class_name}{self.args!r}"

    def __eq__(self, other) -> bool:
        return isinstance(other, MegatronObject) and (self.class_name, self.args) == (other.class_name, other.args)

    def __hash__(self) -> int:
        return hash((self.class_name, self.args))


def _stand_in(full_name: str) -> type:
    return type(full_name.rsplit(".", 1)[1], (MegatronObject,), {"class_name": full_name})


def _numpy_globals() -> dict[str, Any]:
    """numpy's array-rebuilding globals under the names numpy 1.x and 2.x pickle them with."""
    try:
        import numpy  # optional dependency: absent, no numpy arrays are allowed
    except ImportError:
        return {}
    reconstruct = getattr(numpy, "_core", numpy.core).multiarray._reconstruct
    found = {f"{prefix}.multiarray._reconstruct": reconstruct for prefix in ("numpy.core", "numpy._core")}
    found.update({"numpy.ndarray": numpy.ndarray, "numpy.dtype": numpy.dtype})
    for name in dir(getattr(numpy, "dtypes", None) or ()):  # numpy >= 1.25 pickles dtypes by class
        if name.endswith("DType"):
            found[f"numpy.dtypes.{name}"] = getattr(numpy.dtypes, name)
    return found


def allowed_globals(found: list[str]) -> dict[str, Any]:
    """The objects the globals ``found`` in a file stand for, when every one is allowed."""
    allowed = {"argparse.Namespace": argparse.Namespace, "types.SimpleNamespace": types.SimpleNamespace,
               "_io.BytesIO": io.BytesIO, "io.BytesIO": io.BytesIO, "pathlib.PosixPath": pathlib.PosixPath,
               "signal.Signals": signal.Signals, **_numpy_globals()}
    objects, refused = {}, []
    for name in found:
        if name in allowed:
            objects[name] = allowed[name]
        elif name in MEGATRON_CLASSES:
            objects[name] = _stand_in(name)
        else:
            refused.append(name)
    if refused:
        raise _Refused(refused)
    if any(name.startswith("numpy") for name in found):  # arrays' dtypes are built as their classes
        objects.update({name: obj for name, obj in _numpy_globals().items() if name.startswith("numpy.dtypes.")})
    return objects


class _Refused(Exception):
    def __init__(self, names: list[str]):
        super().__init__(", ".join(names))
        self.names = names


def load_megatron_pickle(path: Path) -> Any:
    """The object a Megatron-LM ``torch.save`` file holds, tensors on the CPU (memory-mapped: a rank
    file's optimizer state is paged in only if used, never here).

    Raises :class:`ConversionError` naming the file and the class when the file pickles
    anything but tensors, containers and the objects listed in this module's docstring."""
    registered = torch.serialization.get_safe_globals()  # others' (megatron-core's): set aside
    torch.serialization.clear_safe_globals()
    try:
        return _load(path)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(registered)


def _load(path: Path) -> Any:
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except FileNotFoundError:
        raise ConversionError(f"{path} is missing") from None
    except Exception as error:  # not a zip written by torch.save, or damaged
        raise ConversionError(f"{path} is not a readable torch.save file (truncated or damaged?): "
                              f"{type(error).__name__}: {error}") from None
    try:
        objects = allowed_globals(found)
    except _Refused as refused:
        raise ConversionError(f"{path} pickles {', '.join(refused.names)}, which mega does not unpickle (only "
                              "tensors, containers, the args' namespace, paths and signals, Megatron's enums and "
                              "records, RNG states and io.BytesIO are allowed); the file was not loaded") from None
    try:
        with torch.serialization.safe_globals([(obj, name) for name, obj in objects.items()]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise ConversionError(f"{path} could not be read (truncated or damaged?): "
                              f"{type(error).__name__}: {error}") from None
