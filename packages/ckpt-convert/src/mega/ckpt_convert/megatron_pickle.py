"""Reading the pickles Megatron-LM writes (legacy ``model_optim_rng.pt``, torch_dist ``common.pt``)
without unpickling anything we did not list.

``torch.load(weights_only=True)`` already refuses every class but tensors and plain containers;
Megatron's files also hold a few objects of their own, allowed here by name and nothing else:

* ``argparse.Namespace``: the run's arguments (``args``);
* Megatron's enums (``args.model_type`` is a ``ModelType``, ``args.attention_backend`` an
  ``AttnBackend``...): megatron is not a dependency, so each comes back as a :class:`MegatronEnum`
  holding the enum's name and the pickled value;
* ``io.BytesIO``: Transformer Engine's ``_extra_state`` in older versions;
* numpy arrays: the numpy RNG state tuple in ``rng_state`` (Python's own RNG state is a tuple of
  ints, torch's a tensor).

Any other class in a file is refused before a byte is unpickled, naming the class.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

import torch

from mega.ckpt_convert.errors import ConversionError

# Modules whose enums Megatron-LM pickles in its args (checked by name: megatron is not imported).
MEGATRON_ENUM_MODULES = ("megatron.core.enums", "megatron.core.transformer.enums", "megatron.training.enums",
                         "megatron.core.fp8_utils", "megatron.core.rerun_state_machine")


class MegatronEnum:
    """A Megatron enum member read from a pickle: the enum's dotted name and the member's value."""

    enum_name = ""

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return f"{self.enum_name}({self.value!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, MegatronEnum) and (self.enum_name, self.value) == (other.enum_name, other.value)

    def __hash__(self) -> int:
        return hash((self.enum_name, self.value))


def _enum_stand_in(full_name: str) -> type:
    return type(full_name.rsplit(".", 1)[1], (MegatronEnum,), {"enum_name": full_name})


def _numpy_globals() -> dict[str, Any]:
    """numpy's array-rebuilding globals under the names numpy 1.x and 2.x pickle them with."""
    try:
        import numpy
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
    allowed = {"argparse.Namespace": argparse.Namespace, "_io.BytesIO": io.BytesIO, "io.BytesIO": io.BytesIO,
               **_numpy_globals()}
    objects, refused = {}, []
    for name in found:
        if name in allowed:
            objects[name] = allowed[name]
        elif name.rsplit(".", 1)[0] in MEGATRON_ENUM_MODULES:
            objects[name] = _enum_stand_in(name)
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
    """The object a Megatron-LM ``torch.save`` file holds, tensors on the CPU.

    Raises :class:`ConversionError` naming the file and the class when the file pickles
    anything but tensors, containers and the objects listed in this module's docstring."""
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
                              "tensors, containers, argparse.Namespace, Megatron's enums, RNG states and "
                              "io.BytesIO are allowed); the file was not loaded") from None
    try:
        with torch.serialization.safe_globals([(obj, name) for name, obj in objects.items()]):
            # mmap: a rank file (optimizer state included) is paged in as its tensors are used, not read whole
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise ConversionError(f"{path} could not be read (truncated or damaged?): "
                              f"{type(error).__name__}: {error}") from None
