"""The whole gradient of every parameter of a tensor-parallel rank: shards gathered, the
sequence-parallel replicas' partial gradients summed (what one process computes)."""

from __future__ import annotations


def whole_gradients(named_parameters, tp) -> dict:
    from mega.core.parallel.collectives import all_reduce
    from mega.core.parallel.layers import gather_shards
    from mega.core.parallel.param_attrs import is_sequence_parallel, is_tensor_parallel

    grads = {}
    for name, param in named_parameters:
        grad = param.grad.clone()
        if tp is not None and is_tensor_parallel(param):
            grad = gather_shards(grad, tp, param.partition_dim, param.partition_chunks)
        elif tp is not None and is_sequence_parallel(param):
            all_reduce(grad, tp)
        grads[name] = grad
    return grads
