"""``mega_checkpoint.json``: what a checkpoint is, beside its tensors, as plain JSON.

It is written last into a checkpoint directory (before the directory gets its final name), so
a directory whose metadata parses and whose listed files all have their recorded sizes is
complete. Everything that is not a tensor (iteration, data position, loss scaler, the layout and
model config it was saved with, RNG states) lives here or in ``rng/*.json``, never in a pickle.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "mega-checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "mega_checkpoint.json"
DCP_METADATA_FILE = ".metadata"  # torch.distributed.checkpoint's index of every tensor piece


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the directory or file and the problem."""


# Model-config fields older mega versions saved that are no longer model settings, with where
# they went; a checkpoint that records one still loads (the run's own setting applies).
RETIRED_MODEL_CONFIG_FIELDS = {
    "expert_tensor_parallel_size": "a layout setting since mega-core's ParallelConfig.etp; expert weights are "
                                   "saved whole, so any layout can load them",
}


@dataclass
class CheckpointMetadata:
    iteration: int
    model_family: str
    model_config: dict[str, Any]  # the family config_class's fields
    layout: dict[str, Any] = field(default_factory=dict)  # tp, pp, dp, cp, vpp, world_size, ...
    tokenizer: dict[str, Any] | None = None  # {"type", "options"}; files under tokenizer/
    num_parameters: int = 0
    consumed_samples: int = 0
    consumed_valid_samples: int = 0  # evaluations continue through the validation set
    skipped_iterations: int = 0
    nan_iterations: int = 0
    # {"state_keys": [...], "scalars": {...}, "main_params": bool} of the inner optimizer
    optimizer: dict[str, Any] | None = None
    grad_scaler: dict[str, Any] | None = None
    run_config: dict[str, Any] | None = None
    # What a converted checkpoint was converted from (mega convert: a Hugging Face directory's
    # architecture, naming, the heads initialised on import), so an export gives back what came in.
    source: dict[str, Any] | None = None
    # A checkpoint of adapters alone (a LoRA run's): their settings and trainable parameters, and
    # the base they adapt ({"path", "iteration", "fingerprint"}; adapters.py), else None.
    adapter: dict[str, Any] | None = None
    # Every tensor the save meant to write -> its global shape (completeness.py checks the index
    # against it); None in checkpoints saved before it was recorded.
    tensors: dict[str, list[int]] | None = None
    files: dict[str, int] = field(default_factory=dict)  # every other file -> its size in bytes
    checksums: dict[str, str] = field(default_factory=dict)  # every other file -> "crc32:..." (checksums.py)
    mega_version: str = ""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def read(cls, directory: Path) -> CheckpointMetadata:
        path = directory / METADATA_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{directory} is not a complete mega checkpoint: {METADATA_FILE} is missing") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{path} is not valid JSON ({error}); the checkpoint is damaged") from None
        found = data.get("format") if isinstance(data, dict) else None
        if found != FORMAT:
            raise CheckpointError(f"{path} does not describe a mega checkpoint (format {found!r})")
        if data.get("format_version", 0) > FORMAT_VERSION:
            raise CheckpointError(f"{path} has format version {data['format_version']}; this mega reads up to "
                                  f"{FORMAT_VERSION}: upgrade mega-core")
        known = {f.name for f in dataclasses.fields(cls)}
        missing = [name for name in ("iteration", "model_family", "model_config") if name not in data]
        if missing:
            raise CheckpointError(f"{path} lacks the field(s) {', '.join(missing)}")
        if isinstance(data["model_config"], dict):
            data["model_config"] = {key: value for key, value in data["model_config"].items()
                                    if key not in RETIRED_MODEL_CONFIG_FIELDS}
        return cls(**{key: value for key, value in data.items() if key in known})
