"""What one rank holds under FSDP2 (``--data-parallel-sharding-strategy optim_grads`` or
``optim_grads_params``), as :mod:`mega.core.parallel.fsdp` shards a stage.

Between steps a rank holds its shard (1/S of every parameter, S = dp x cp / replicas under HSDP):

    weights      the fp32 sharded parameters (they are the optimizer's main weights: no copy)
    gradients    their fp32 sharded gradients (FSDP casts the reduce-scattered shard to the
                 parameter's dtype)
    optimizer    the inner optimizer's state of the shard (Adam: two fp32 moments)

With ``--cpu-offload`` these three live in host memory (``host``), not on the device.

On top, at the peak, what FSDP gathers (``gathered``), in the compute dtype:

    weights      the units being computed: the root unit (embedding, final norm, output layer),
                 the layer running and the next one, prefetched. Every unit stays gathered from
                 its forward to its backward where nothing reshards after forward: optim_grads,
                 ``--fsdp-reshard-after-forward never``, the default under pipeline parallelism
                 (a unit's forward and backward come for every micro-batch), a family whose
                 stage is one unit (no ``compile_units``).
    gradients    the unsharded gradients not yet reduce-scattered: the output layer's (the root
                 reduces at the end of the backward; the embedding's come last, when the layers'
                 activations are gone) and one layer's; with several micro-batches a step, every
                 unit's, accumulated unsharded (``set_requires_gradient_sync(False)``, as DDP's
                 ``no_sync()``) in the reduction dtype until the last micro-batch's backward, plus
                 those of the micro-batch being computed where it is in another dtype.

The copy buffers of one all-gather and one reduce-scatter (a unit's size each, freed after the
copy) are transient like the other temporaries the plan leaves out. Experts are sharded over
the expert-data-parallel group, which the family's footprint does not tell apart: counted as
dense parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FP32 = 4


@dataclass(frozen=True)
class ShardedStage:
    """One pipeline rank's chunks as FSDP sees them."""

    parameters: int  # elements of every chunk's parameters (this rank's tensor-parallel shards)
    root: int  # elements of the largest chunk's root unit (what the layers leave)
    output_layer: int  # elements of the output layer's weight (0 on a stage without it)
    layer: int  # elements of one transformer layer (a unit)
    layers: int  # transformer layers of this rank (over its chunks)
    units: bool  # the family names its layers as units (else a chunk is one unit)


@dataclass(frozen=True)
class HeldBytes:
    weights: int
    gradients: int
    optimizer: int
    gathered: int
    host: int


def resharded_after_forward(layout) -> bool:
    """Whether the layers free their gathered weights after forward (``shard_stage``'s policy)."""
    if layout.sharding != "optim_grads_params" or layout.reshard_after_forward == "never":
        return False
    return layout.reshard_after_forward == "always" or layout.pp == 1


def fully_sharded_bytes(stage: ShardedStage, layout, *, dtype_bytes: int, reduce_dtype_bytes: int,
                        state_bytes_per_param: int, accumulating: bool) -> HeldBytes:
    """Bytes of one rank of ``stage`` under ``layout``'s FSDP strategy; ``reduce_dtype_bytes``: of
    the reduction (fp32 unless ``--no-accumulate-allreduce-grads-in-fp32``), ``accumulating``:
    more than one micro-batch a step."""
    shard = layout.dp * layout.cp // layout.replicas
    sharded = math.ceil(stage.parameters / shard)
    weights, gradients, optimizer = sharded * FP32, sharded * FP32, sharded * state_bytes_per_param
    if stage.units and resharded_after_forward(layout):
        live = min(stage.parameters, stage.root + min(2, stage.layers) * stage.layer)
    else:
        live = stage.parameters
    computing = min(stage.parameters, stage.output_layer + stage.layer) if stage.units else stage.parameters
    if not accumulating:
        unreduced = computing * dtype_bytes
    else:
        unreduced = stage.parameters * reduce_dtype_bytes
        unreduced += computing * dtype_bytes if reduce_dtype_bytes != dtype_bytes else 0  # added in after the unit
    gathered = live * dtype_bytes + unreduced
    if layout.cpu_offload:
        return HeldBytes(0, 0, 0, gathered, weights + gradients + optimizer)
    return HeldBytes(weights, gradients, optimizer, gathered, 0)
