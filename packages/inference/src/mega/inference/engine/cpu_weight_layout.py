"""Linear weights held column-major for decoding on the CPU.

A decode step multiplies one row of activations per sequence by every weight. With a weight
held as torch stores it (row-major ``[out, in]``), MKL's matrix-vector product runs far below
the memory's bandwidth on the CPUs measured: on the development machine's AMD EPYC (one
thread, fp32) the 50,304 x 384 output layer of one token takes 16-18 ms that way and 3.3 ms
with the same values held column-major (``[in, out]`` in memory, the product streaming the
weight once), about one pass over its memory. A 6-layer hidden-384 LLaMA's 1-token request
took 12.9 ms of CPU instead of 17.1, 16 decode steps 211 ms instead of 276, and a 1,040-token
prefill was no slower (408 against 414 ms). So the CPU engines of ``mega
generate`` and ``mega serve`` hold their linear weights that way: the same shapes and values,
only the strides change, and ``F.linear`` reads them as they are. The products are summed in
another order: logits may differ in their last bits from the row-major ones (greedy tokens
checked equal on the benchmarks' models, docs/benchmarks.md).

Only engines that own their model do this; the RL engine shares the trainer's parameters,
whose layout the optimizer and the gradient buffers expect. Quantized weights (tensor
subclasses) are left as they are: quantize first, or they keep their own layout.
"""

from __future__ import annotations

import torch
from torch import nn

from mega.core.parallel.layers import ColumnParallelLinear, RowParallelLinear


def hold_linear_weights_column_major(model: nn.Module) -> int:
    """Re-lay every plain floating-point linear weight of ``model`` on the CPU column-major (in
    place: the parameters stay the same objects, tied ones too); returns how many were."""
    count = 0
    for module in model.modules():
        if not isinstance(module, (nn.Linear, ColumnParallelLinear, RowParallelLinear)):
            continue
        weight = module.weight
        # Quantized weights (tensor subclasses) and accelerators' keep their own layouts.
        if (type(weight.data) is not torch.Tensor or weight.device.type != "cpu" or weight.dim() != 2
                or not weight.is_floating_point() or not weight.is_contiguous()):
            continue
        with torch.no_grad():
            weight.data = weight.data.t().contiguous().t()
        count += 1
    return count
