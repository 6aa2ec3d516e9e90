"""Saving and resuming a training run: ``--save``, ``--save-interval``, ``--load`` and friends.

A save writes the run's model and optimizer entries (:mod:`mega.core.checkpoint.state`), each
rank's RNG states and the tokenizer into a staging directory, then one process publishes it
(:mod:`mega.core.checkpoint.directory`). With ``--async-save`` the step loop waits only while
the tensors are copied; a background thread writes and publishes them, and the next save (or
the end of training) waits for it.

A load restores weights, optimizer state, loss scaler, iteration, consumed samples and every
rank's RNG streams, so the resumed run continues as if it had never stopped. Saved and loading
layouts may differ; RNG states are then left alone (each rank's streams belong to its place in
the old layout), as Megatron does.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mega.core.checkpoint import rng, space
from mega.core.checkpoint.adapter_record import adapter_record, base_record
from mega.core.checkpoint.adapters import check_adapters_only, restrict_to_part
from mega.core.checkpoint.completeness import check_complete, confirm_written, union_over_ranks
from mega.core.checkpoint.config import CheckpointConfig
from mega.core.checkpoint.config_check import check_model_config
from mega.core.checkpoint.directory import (
    RELEASE,
    find_checkpoint,
    iteration_name,
    prune,
    publish,
    remove_leftovers,
    staging_path,
)
from mega.core.checkpoint.foreign import foreign_format
from mega.core.checkpoint.lock import SaveDirLock
from mega.core.checkpoint.metadata import CheckpointError, CheckpointMetadata
from mega.core.checkpoint.model_io import load_model_weights
from mega.core.checkpoint.sharded_io import ShardedEntry, load_entries, read_index, save_entries
from mega.core.checkpoint.state import (
    MAIN_PARAM,
    MODEL,
    OPTIMIZER,
    create_optimizer_state,
    expected_optimizer_shapes,
    model_entries,
    named_parameters,
    optimizer_entries,
    optimizer_state_description,
    prepare_optional,
    refresh_main_params,
    settle,
)
from mega.core.checkpoint.tokenizer_files import copy_tokenizer_files, tokenizer_entry
from mega.core.checkpoint.validate import check_entries, check_model_names, zero_rows_beyond
from mega.core.model_family import ModelFamily
from mega.core.parallel.groups import ParallelGroups
from mega.core.parallel.pieces import Piece
from mega.core.version import __version__


@dataclass
class TrainingState:
    """What a checkpoint saves and restores, handed over explicitly: this rank's model chunks
    (DDP-wrapped or not), the optimizer (its fp16 loss scaler inside), the RNG tracker, the
    progress (``iteration``, ``consumed_samples`` - the data position -, skipped and NaN
    iteration counts; the learning-rate schedule is a function of the iteration), and what
    describes the run in the metadata (family, run config, tokenizer). ``whole_model_on_meta``
    builds the whole model on the meta device (a load checks the checkpoint holds all its
    parameters; the caller builds it, so checkpoints need nothing from build). ``events`` hears
    ``on_checkpoint``."""

    chunks: list[nn.Module]
    optimizer: Any
    rng_tracker: Any
    progress: Any
    family: ModelFamily
    run: Any
    whole_model_on_meta: Callable[[], nn.Module]
    tokenizer_spec: Any = None
    events: Any = None


class Checkpointer:
    def __init__(self, config: CheckpointConfig, groups: ParallelGroups, state: TrainingState):
        self.state = state
        self.config = config
        self.groups = groups
        # Checkpoint collectives get a group of their own: an asynchronous save runs them on a
        # background thread while training keeps using the others.
        self.process_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._pending: tuple[Future, float] | None = None  # a background save and when it began
        self._executor: ThreadPoolExecutor | None = None
        self._last_saved: int | None = None
        self._base: dict | None = None  # the base a LoRA run's adapters adapt: the weights --load gave
        # One run saves into a directory at a time (the lock is refused, naming its holder).
        self._lock = SaveDirLock(self.config.save) if self.config.save and self.is_writer else None

    @property
    def is_writer(self) -> bool:
        return self.groups.global_rank == 0

    def _barrier(self) -> None:
        if self.process_group is not None:
            dist.barrier(group=self.process_group)

    def _say(self, message: str) -> None:
        if self.is_writer:
            print(message, flush=True)

    # -- saving ------------------------------------------------------------------------------
    def maybe_save(self, iteration: int, last: bool) -> None:
        interval = self.config.save_interval
        due = bool(interval) and iteration % interval == 0
        if self.config.save and (due or last) and self._last_saved != iteration:
            self.save()

    def save(self) -> Path:
        saved, state = self.state, self.state.progress
        self.wait()
        save_dir = Path(self.config.save)
        name = iteration_name(state.iteration)
        staging = staging_path(save_dir, name)
        start = time.perf_counter()
        if self.is_writer:
            save_dir.mkdir(parents=True, exist_ok=True)
            remove_leftovers(save_dir)
            staging.mkdir()
            copy_tokenizer_files(saved.tokenizer_spec, staging)
        self._barrier()
        rng.write(staging, self.groups.global_rank, saved.rng_tracker)
        settle(saved.chunks, saved.optimizer)
        entries, description, adapters = self._entries_to_save()
        metadata = self._metadata(description)
        metadata.tensors = self._expected_tensors(entries, description)
        if adapters:  # a LoRA run: what the adapters are, and their base
            modules = (module for chunk in saved.chunks for module in chunk.modules())
            metadata.adapter = adapter_record(modules, metadata.tensors, self._base)
        self._last_saved = state.iteration
        groups = self.groups
        needed = space.expected_bytes(save_dir, entries, groups.tp.size * groups.pp.size * groups.cp.size)
        if self.is_writer:
            space.warn_if_short(save_dir, needed)

        def write(entries: dict) -> Path:
            with space.removed_if_failed(staging, needed):  # a full disk: one clear error, nothing left
                save_entries(staging, entries, self.process_group)
                confirm_written(staging, metadata.tensors, self.process_group)  # all there, or nothing published
                if self.is_writer:  # its save returns once every rank's shards are written
                    final = publish(save_dir, name, metadata, str(metadata.iteration))
            if self.is_writer and self.config.keep_last:
                prune(save_dir, self.config.keep_last, keep=final)
            return save_dir / name

        if not self.config.async_save:
            path = write(entries)
            self._barrier()
            self._say(f"saved checkpoint {path} (iteration {state.iteration}) in {time.perf_counter() - start:.2f} s")
            self._announce(path)
            return path
        staged = {key: _copy(entry) for key, entry in entries.items()}
        blocked = time.perf_counter() - start
        self._executor = self._executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="mega-ckpt")
        self._pending = (self._executor.submit(write, staged), start)
        self._say(f"checkpoint {save_dir / name}: training blocked {blocked:.3f} s; writing in the background")
        return save_dir / name

    def poll(self) -> None:
        """Announce a finished background save (cheap; no collectives)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Wait for the background save, if any, and re-raise its error."""
        if self._pending is None:
            return
        (future, start), self._pending = self._pending, None
        path = future.result()
        self._say(f"saved checkpoint {path} in the background in {time.perf_counter() - start:.2f} s")
        self._announce(path)

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        if self._lock is not None:
            self._lock.release()

    def _announce(self, path: Path) -> None:
        state = self.state.progress
        if self.state.events is not None:
            self.state.events.hook.on_checkpoint(run=state, iteration=state.iteration, path=str(path))

    def _entries_to_save(self) -> tuple[dict, dict | None, bool]:
        """The entries to write, the optimizer state's description, and whether they are adapters alone."""
        saved = self.state
        model = model_entries(saved.chunks, self.groups.tp)
        # A model with adapters (LoRA) saves them alone: its frozen base is --load's.
        entries = {key: entry for key, entry in model.entries.items()
                   if not key.startswith(MODEL) or key in model.optional or not model.adapters}
        description = optimizer_state_description(saved.optimizer)
        if description is not None:
            entries.update(optimizer_entries(saved.optimizer, saved.chunks, self.groups.tp,
                                             description["state_keys"], description["main_params"]).entries)
        return entries, description, model.adapters

    def _expected_tensors(self, entries: dict, description: dict | None) -> dict | None:
        """Every tensor this save must write, named from the model on every rank (gathered onto the
        writer; None elsewhere): the model's entries, and each trainable parameter's optimizer state."""
        expected = {key: list(entry.global_shape) for key, entry in entries.items() if not key.startswith(OPTIMIZER)}
        if description is not None:
            expected.update(expected_optimizer_shapes(self.state.optimizer, self.state.chunks, self.groups.tp,
                                                      description["state_keys"], description["main_params"]))
        return union_over_ranks(expected, self.process_group)

    def _metadata(self, optimizer: dict | None) -> CheckpointMetadata:
        saved, state, run = self.state, self.state.progress, self.state.run
        scaler = saved.optimizer.grad_scaler
        return CheckpointMetadata(
            iteration=state.iteration,
            model_family=saved.family.name,
            model_config=dataclasses.asdict(run.model),
            layout=layout_of(run, self.groups),
            tokenizer=tokenizer_entry(saved.tokenizer_spec),
            num_parameters=saved.family.num_parameters(run.model, self.groups.tp.size),
            consumed_samples=state.consumed_samples,
            consumed_valid_samples=state.consumed_valid_samples,
            skipped_iterations=state.skipped_iterations,
            nan_iterations=state.nan_iterations,
            optimizer=optimizer,
            grad_scaler=None if scaler is None else scaler.state_dict(),
            run_config=json.loads(json.dumps(dataclasses.asdict(run), default=str)),
            mega_version=__version__,
        )

    # -- loading -----------------------------------------------------------------------------
    def load(self) -> None:
        """Restore the run from ``--load`` (nothing when that directory holds no checkpoint yet);
        with ``--load-adapter``, the base's weights from ``--load``, then the LoRA adapters and the
        run (optimizer, iteration, data position, RNG) from ``--load-adapter``."""
        if self.config.load_adapter is None:
            self._load_from(self.config.load, self.config.finetune)
            return
        self._load_from(self.config.load, finetune=True, part="base")
        self._load_from(self.config.load_adapter, self.config.finetune, part="adapters")

    def _load_from(self, location: str, finetune: bool, part: str | None = None) -> None:
        """``part``: None (the whole model), ``base`` (all but the adapters) or ``adapters`` (only them)."""
        saved, state, config = self.state, self.state.progress, self.config
        flag = "--load-adapter" if part == "adapters" else "--load"
        foreign = foreign_format(location, capability="load_for_training") if part != "adapters" else None
        if foreign is not None:
            self._load_foreign(foreign)
            return
        found = find_checkpoint(location, checksums=config.verify_checksums)
        if found is None:
            if finetune or part is not None:  # weights were asked for: training random ones would waste the run
                raise CheckpointError(f"{'--finetune' if part is None else flag}: {location} holds no checkpoint "
                                      f"to {'fine-tune' if part is None else 'load'} from")
            if not Path(location).exists() and self.is_writer:  # often a typo; say so loudly
                print(f"WARNING: --load {location} does not exist: training starts from scratch",
                      file=sys.stderr, flush=True)
            self._say(f"no checkpoint in {location} yet; starting from scratch")
            return
        path, metadata = found
        if metadata.model_family != saved.family.name:
            raise CheckpointError(f"{path} holds a {metadata.model_family!r} model; this run trains "
                                  f"{saved.family.name!r} (--model-family)")
        check_model_config(path, metadata.model_config, saved.run.model)
        weights_only = finetune or path.name == RELEASE
        with_optimizer = not weights_only and config.load_optim and metadata.optimizer is not None
        settle(saved.chunks, saved.optimizer)
        wanted = model_entries(saved.chunks, self.groups.tp)
        if with_optimizer:
            create_optimizer_state(saved.optimizer, metadata.optimizer)
            optimizer = optimizer_entries(saved.optimizer, saved.chunks, self.groups.tp,
                                          metadata.optimizer["state_keys"], metadata.optimizer["main_params"])
            wanted.entries.update(optimizer.entries)
            wanted.sources.update(optimizer.sources)
            for key in optimizer.main_param_instead:  # one tensor, loaded once: from its fp32 copy
                del wanted.entries[key], wanted.sources[key]
        # fp32 main weights come from the checkpoint when it has them, else from the loaded weights
        loads_main_params = any(key.endswith("." + MAIN_PARAM) for key in wanted.entries)
        index = read_index(path)
        check_adapters_only(path, index, part, flag)
        check_complete(path, metadata, index, optimizer=with_optimizer)
        check_model_names(path, *restrict_to_part(wanted, part, full_model_names(saved), index))
        extra_state = prepare_optional(wanted, index)
        check_entries(path, wanted, index)
        zero_rows_beyond(wanted, index)
        load_entries(path, wanted.entries, self.process_group)
        with torch.no_grad():
            for first, copy in wanted.duplicates:
                copy.copy_(first)
        for module, extra in extra_state:
            module.set_extra_state(extra)
        if not loads_main_params:
            refresh_main_params(saved.optimizer.main_params)
        # The loss scaler has state before the optimizer has any (fp16 skips its first steps).
        restore_scaler = not weights_only and config.load_optim
        if restore_scaler and saved.optimizer.grad_scaler is not None and metadata.grad_scaler is not None:
            saved.optimizer.grad_scaler.load_state_dict(metadata.grad_scaler)
        if not weights_only:
            state.iteration = metadata.iteration
            state.consumed_samples = metadata.consumed_samples
            state.consumed_valid_samples = metadata.consumed_valid_samples
            state.skipped_iterations = metadata.skipped_iterations
            state.nan_iterations = metadata.nan_iterations
            self._last_saved = metadata.iteration
            self._restore_rng(path, metadata)
        if part != "adapters":
            self._base = base_record(path, metadata)
        self._barrier()
        what = "weights" if weights_only else "weights" + (", optimizer" if with_optimizer else "") + " and run state"
        self._say(f"loaded checkpoint {path} ({what}; saved at iteration {metadata.iteration}, "
                  f"layout {_layout_text(metadata.layout)})")

    def _load_foreign(self, checkpoint_format) -> None:
        """The weights of a checkpoint in another format (a Megatron-LM directory), converted by its
        plugin as they are read; optimizer, RNG and data position start fresh, as with --finetune."""
        saved, path = self.state, Path(self.config.load)
        unused = {"allow_unused": True} if self.config.allow_unused_tensors else {}  # older formats lack it
        with checkpoint_format.open(path, saved.family.name, **unused) as source:
            check_model_config(path, dataclasses.asdict(source.config), saved.run.model)
            load_model_weights(source, saved.chunks, self.groups)
            kind = getattr(source, "kind", "")
            iteration = getattr(source, "iteration", None)
            for warning in getattr(source, "warnings", []):  # tensors left out, heads initialised...
                self._say(f"warning: {warning}")
        refresh_main_params(saved.optimizer.main_params)
        self._base = base_record(path, None)
        self._barrier()
        self._say(f"loaded {checkpoint_format.name} {kind} checkpoint {path} (saved at iteration {iteration}): "
                  "weights converted on the fly; optimizer, RNG and data position start fresh at iteration 0")

    def _restore_rng(self, path: Path, metadata: CheckpointMetadata) -> None:
        if not self.config.load_rng:
            return
        here = layout_of(self.state.run, self.groups)
        if {k: metadata.layout.get(k) for k in RNG_LAYOUT_KEYS} != {k: here[k] for k in RNG_LAYOUT_KEYS}:
            self._say(f"the checkpoint's layout ({_layout_text(metadata.layout)}) differs from this run's "
                      f"({_layout_text(here)}): RNG states are not restored")
            return
        if not rng.rng_file(path, self.groups.global_rank).is_file():  # converted from another format
            self._say(f"{path} carries no RNG states (a converted checkpoint): they start fresh")
            return
        rng.restore(rng.read(path, self.groups.global_rank), self.state.rng_tracker)


def full_model_names(state: TrainingState) -> set[str]:
    """Canonical parameter names of the whole model (built on the meta device: nothing is allocated)."""
    return set(named_parameters([state.whole_model_on_meta()])[0])


RNG_LAYOUT_KEYS = ("world_size", "tp", "pp", "dp", "cp", "vpp")


def layout_of(run, groups) -> dict:
    return {
        "world_size": groups.world_size, "tp": groups.tp.size, "pp": groups.pp.size, "dp": groups.dp.size,
        "cp": groups.cp.size, "ep": groups.ep.size, "vpp": run.parallel.vpp or 1,
        "sequence_parallel": run.parallel.sequence_parallel,
        "distributed_optimizer": run.optimizer.use_distributed_optimizer,
        "data_parallel_strategy": run.data_parallel.strategy(run.optimizer.use_distributed_optimizer),
        "data_parallel_replicas": run.data_parallel.replicas,
    }


def _layout_text(layout: dict) -> str:
    return " x ".join(f"{key}{layout.get(key, 1)}" for key in ("tp", "pp", "dp", "vpp"))


def _copy(entry: ShardedEntry) -> ShardedEntry:
    """A host-memory snapshot of an entry's pieces, which training may change while it is written."""
    return dataclasses.replace(entry, pieces=[Piece(p.data.to("cpu", copy=True), p.offsets) for p in entry.pieces])
