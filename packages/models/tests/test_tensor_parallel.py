"""Tensor parallelism by the core's layer swap: tp=2, with and without sequence parallelism,
computes the single-process model's logits, loss and gradients (fp32, gloo)."""

from __future__ import annotations

import torch

from mega.core.parallel import ParallelConfig

FAMILIES = ("gpt", "llama")
BATCH, SEQ, SEED = 2, 16, 21


def tiny_config(family):
    # vocab 256 pads to 256 at tp 1 and 2 alike, so both layouts compute the same function.
    return family.preset("tiny", vocab_size=256, seq_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0)


def batch():
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (BATCH, SEQ), generator=generator), torch.randint(0, 256, (BATCH, SEQ), generator=generator)


def run_step(family_name: str, parallel: ParallelConfig, groups=None):
    """Logits [s, b, V] (gathered), mean loss and full gradients by name, after one backward."""
    from mega.core.build import build_stage
    from mega.core.parallel.collectives import all_reduce, gather_along
    from mega.core.parallel.layers import gather_shards
    from mega.core.parallel.param_attrs import is_sequence_parallel, is_tensor_parallel
    from mega.core.plugins import get_plugins

    family = get_plugins().models.get(family_name)
    config = tiny_config(family)
    model = build_stage(family, config, groups=groups, parallel=parallel, seed=SEED)
    tp_group = None
    if groups is not None:
        tp_group = groups.tp
        if not config.untie_embeddings_and_output_weights:
            assert model.output_layer.weight is model.embedding.word_embeddings.weight
    ids, labels = batch()
    logits = model(ids)
    loss = model.loss(logits, labels, tp_group).mean()
    loss.backward()
    if groups is None:
        return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        if is_tensor_parallel(param):
            grad = gather_shards(grad, tp_group, param.partition_dim, param.partition_chunks)
        elif is_sequence_parallel(param):  # computed on sequence shards: the parts add up
            all_reduce(grad, tp_group)
        grads[name] = grad
    return gather_along(logits.detach(), tp_group, dim=-1), loss.detach(), grads


def two_stage_logits(family_name: str, parallel: ParallelConfig, groups):
    """Two pipeline stages (layer 0 | layer 1), each made tensor-parallel with its own plan."""
    from mega.core.build import build_stage
    from mega.core.parallel.collectives import gather_along
    from mega.core.plugins import get_plugins

    family = get_plugins().models.get(family_name)
    config = tiny_config(family)
    # layer 0 | layer 1; each stage's plan is strict: it names only what the stage holds
    stages = [build_stage(family, config, stage, groups=groups, seed=SEED) for stage in family.pipeline_stages(config, 2)]
    with torch.no_grad():
        hidden = stages[0](batch()[0])
        assert hidden.shape[0] == SEQ // (2 if parallel.sequence_parallel else 1)
        return gather_along(stages[1](hidden), groups.tp, dim=-1)


def tensor_parallel_steps():
    from mega.core.parallel import ParallelGroups

    results = {}
    for family_name in FAMILIES:
        for sequence_parallel in (False, True):
            parallel = ParallelConfig(tp=2, sequence_parallel=sequence_parallel)
            groups = ParallelGroups(parallel)
            results[family_name, sequence_parallel] = (*run_step(family_name, parallel, groups),
                                                       two_stage_logits(family_name, parallel, groups))
    return results


def test_tensor_parallel_equals_one_process(worlds, assert_close):
    ranks = worlds.run(2, tensor_parallel_steps)
    for family_name in FAMILIES:
        ref_logits, ref_loss, ref_grads = run_step(family_name, ParallelConfig())
        for sequence_parallel in (False, True):
            for rank, results in enumerate(ranks):
                where = f"{family_name} sp={sequence_parallel} rank {rank}"
                logits, loss, grads, staged_logits = results[family_name, sequence_parallel]
                assert_close(logits, ref_logits, what=f"{where} logits")
                assert_close(staged_logits, ref_logits, what=f"{where} two-stage logits")
                assert_close(loss, ref_loss, what=f"{where} loss")
                assert set(grads) == set(ref_grads)
                for name, grad in ref_grads.items():
                    assert_close(grads[name], grad, what=f"{where} grad {name}")
