"""Every random stream of a rank as JSON, so a resumed run draws the numbers it would have drawn.

Python's and numpy's generators, torch's CPU (and accelerator) generator, and the tracker's
model-parallel streams. Byte states are base64; nothing is pickled.
"""

from __future__ import annotations

import base64
import json
import os
import random
from pathlib import Path

import numpy as np
import torch

from mega.core.parallel.random import RNGStatesTracker, get_device_rng_state, set_device_rng_state


def rng_file(directory: Path, rank: int) -> Path:
    return directory / "rng" / f"rank_{rank:05d}.json"


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def capture(tracker: RNGStatesTracker) -> dict:
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states = {
        "python": [version, list(state), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _encode(torch.get_rng_state()),
        "tracker": {name: _encode(s) for name, s in tracker.get_states().items()},
    }
    if tracker.device.type != "cpu":
        states["device"] = _encode(get_device_rng_state(tracker.device).cpu())
    return states


def restore(states: dict, tracker: RNGStatesTracker) -> None:
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_decode(states["torch"]))
    tracker.set_states({name: _decode(s) for name, s in states["tracker"].items()})
    if "device" in states and tracker.device.type != "cpu":
        set_device_rng_state(tracker.device, _decode(states["device"]))


def write(directory: Path, rank: int, tracker: RNGStatesTracker) -> None:
    path = rng_file(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as stream:
        json.dump(capture(tracker), stream)
        stream.flush()
        os.fsync(stream.fileno())


def read(directory: Path, rank: int) -> dict:
    return json.loads(rng_file(directory, rank).read_text())
