"""``build_model`` / ``build_stage``: the one way a rank builds its part of a model (training,
inference, loading, conversion).

    family.build on the meta device -> the setup passes in phase order (mega.core.setup_passes):
    the family's (experts, tensor plan, context parallelism) on meta -> MATERIALIZE (cast,
    this rank's shards on the device, initialised from per-name seeds) -> the family's recompute
    and the run's passes (LoRA, FP8, compile, tying, data parallelism)

Nothing but this rank's shards is ever allocated: a tp8 x pp8 stage of a 70B model costs its
own bytes, not a whole layer's. Initialisation is layout-independent: every global parameter is
cut into blocks of whole rows, each filled from a generator seeded by (seed, name, block), and a
rank fills only the blocks its shard overlaps. A parameter of one block (every small model's)
starts exactly as ``fill(whole_tensor, generator(seed, name))`` would make it.

Where a shard sits in its global parameter is what the parallel passes marked on it
(:mod:`mega.core.parallel.param_attrs`, read through :class:`TensorParallelSplit`), so the same
holds for every split a family's pass marks: tensor-parallel rows or columns, the experts'
own tensor group (``expert_tensor_shard``), and expert parallelism. Experts stacked in one
tensor (dimension 0 the experts) are marked ``expert_shard``; experts held one module each keep
their global names through ``parameter_aliases`` (a rank's local expert 0 initialised as global
expert ``ep_rank * local_experts``), as checkpoints do. tests/test_moe_training.py checks every
family with the ``moe`` feature at ep, tp x ep and expert-tensor-parallel layouts bit for bit.
"""

from __future__ import annotations

import hashlib
import inspect
import math

import torch
from torch import nn

from mega.core.kernels import Kernels
from mega.core.model_family import ModelFamily, ParallelContext, Stage
from mega.core.parallel.config import ParallelConfig
from mega.core.parallel.groups import Group, ParallelGroups
from mega.core.parallel.pieces import Piece, TensorParallelSplit, tensor_pieces
from mega.core.parameter_names import canonical_names
from mega.core.setup_passes import ModelSetup, Phase, SetupPass, run_setup

DEFAULT_SEED = 1234  # Megatron's --seed default
# Elements per initialisation block (a fixed number of whole rows, from the global shape alone).
ROW_BLOCK_ELEMENTS = 1 << 22


def build_model(family: ModelFamily, config, stages: list[Stage], *, groups: ParallelGroups | None = None,
                parallel: ParallelConfig | None = None, kernels: Kernels | None = None, rng_tracker=None,
                seed: int = DEFAULT_SEED, device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32, init: bool = True, training: bool = True,
                passes: list[SetupPass] = (), run=None) -> list[nn.Module]:
    """This rank's model chunks, one per stage of ``stages``, set up by the family's passes, the
    core's materialisation and ``passes`` (a run's), all in phase order (:func:`run_setup`).

    ``groups`` default to one process. ``parallel`` sets the layout the model is shaped for (the
    vocabulary padding) when it differs from ``groups.config`` (shapes of a tp2 model on one
    process). ``device="meta"`` allocates nothing; ``init=False`` leaves the shards uninitialised
    for weights that are loaded next. ``run``: the training run's config, which passes may read.
    """
    groups = groups if groups is not None else ParallelGroups(ParallelConfig())
    parallel = parallel if parallel is not None else groups.config
    device = torch.device(device) if device is not None else groups.device
    context = ParallelContext(groups, parallel.sequence_parallel, rng_tracker)
    chunks = build_on_meta(family, config, stages, kernels or Kernels(), parallel, context)
    setup = ModelSetup(chunks, family, config, groups, parallel, rng_tracker, training, device, dtype, seed, init, run)
    return run_setup(setup, [*family.layout_passes(), MATERIALIZE, *passes])


def build_on_meta(family: ModelFamily, config, stages: list[Stage], kernels: Kernels, parallel: ParallelConfig,
                  context: ParallelContext | None = None) -> list[nn.Module]:
    """The family's module of each stage, on the meta device (nothing allocated); a builder that
    declares ``context`` gets it (its modules take groups and RNG tracker at construction)."""
    extra = {"context": context} if "context" in inspect.signature(family.build).parameters else {}
    chunks = []
    with torch.device("meta"):
        for stage in stages:
            module = family.build(config, stage, kernels=kernels, parallel=parallel, **extra)
            module.stage = stage
            chunks.append(module)
    return chunks


def build_stage(family: ModelFamily, config, stage: Stage | None = None, **options) -> nn.Module:
    """This rank's ``stage`` of ``family``'s model (default: the whole model), made parallel over
    ``groups`` (default: one process) and initialised from ``seed``: :func:`build_model` of one stage."""
    stage = stage if stage is not None else family.whole_model(config)
    return build_model(family, config, [stage], **options)[0]


def _materialize_chunks(setup: ModelSetup) -> None:
    for module in setup.chunks:
        module.to(setup.dtype)
        if setup.device.type == "meta":
            continue
        materialize(module, setup.device)
        if setup.init:
            initialize_parameters(module, setup.family, setup.config, setup.seed, setup.groups.tp)


MATERIALIZE = SetupPass("materialize", Phase.MATERIALIZE, _materialize_chunks,
                        "cast, give this rank's shards storage on the device, initialise them from per-name seeds")


def materialize(module: nn.Module, device: torch.device) -> nn.Module:
    """Give every meta parameter and buffer real (uninitialised) storage on ``device``, keeping
    ties (one tensor used by two modules stays one) and the marks parallelism set on them;
    then let modules that compute buffers (``reset_buffers()``) fill them."""
    replaced: dict[int, torch.Tensor] = {}

    def real(tensor: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(tensor) not in replaced:
            new = torch.empty_like(tensor, device=device)
            if parameter:
                new = nn.Parameter(new, requires_grad=tensor.requires_grad)
            new.__dict__.update(tensor.__dict__)
            replaced[id(tensor)] = new
        return replaced[id(tensor)]

    for owner in module.modules():
        for key, param in owner._parameters.items():
            if param is not None:
                owner._parameters[key] = real(param, parameter=True)
        for key, buffer in owner._buffers.items():
            if buffer is not None:
                owner._buffers[key] = real(buffer, parameter=False)
    for owner in module.modules():
        if hasattr(owner, "reset_buffers"):
            owner.reset_buffers()
    return module


def parameter_generator(seed: int, name: str, device: torch.device, block: int = 0) -> torch.Generator:
    """A generator seeded from (seed, global name, row block); the same on every rank.

    A hash mixes them into every bit: the CPU generator (mt19937) keeps only the low 32 bits of
    a seed, so packing seed and name side by side would lose one of them.
    """
    key = f"{seed}:{name}" if block == 0 else f"{seed}:{name}:{block}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little"))


@torch.no_grad()
def initialize_parameters(module: nn.Module, family: ModelFamily, config, seed: int, tp: Group | None = None) -> None:
    """Fill every parameter shard of ``module`` with its part of the global parameter that
    ``family.init_parameter`` describes (see the module docstring)."""
    names = canonical_names(module)
    seen: set[int] = set()
    for name, param in module.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        global_name = names.get(name, name)
        fill = family.init_parameter(config, global_name)
        split = TensorParallelSplit.of(param, tp.rank, tp.size) if tp is not None else TensorParallelSplit.of(param, 0, 1)
        shape = split.global_shape(tuple(param.shape))
        for piece in tensor_pieces(param.data, split, tuple(param.shape)):
            _fill_piece(piece, shape, fill, seed, global_name)


def _fill_piece(piece: Piece, shape: tuple[int, ...], fill, seed: int, name: str) -> None:
    data = piece.data
    if data.dim() == 0:
        block = torch.empty((), dtype=torch.float32, device=data.device)
        fill(block, parameter_generator(seed, name, data.device))
        data.copy_(block)
        return
    rows = max(1, ROW_BLOCK_ELEMENTS // max(1, math.prod(shape[1:])))
    first, last = piece.offsets[0], piece.offsets[0] + data.shape[0]
    for index in range(first // rows, (last - 1) // rows + 1):
        lo, hi = index * rows, min((index + 1) * rows, shape[0])
        block = torch.empty((hi - lo, *shape[1:]), dtype=torch.float32, device=data.device)
        fill(block, parameter_generator(seed, name, data.device, index))
        start, stop = max(lo, first), min(hi, last)
        region = block[start - lo:stop - lo]
        for dim in range(1, data.dim()):
            region = region.narrow(dim, piece.offsets[dim], data.shape[dim])
        data[start - first:stop - first].copy_(region)
