"""Tensor and sequence parallelism against one process running the same model and data (fp32, gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mega.core.parallel import ParallelConfig, ParallelGroups
from mega.core.parallel.cross_entropy import cross_entropy, vocab_parallel_cross_entropy
from mega.core.parallel.tensor_parallel import apply_tensor_parallel
from mega.testing.equivalence import max_relative_error
from mega.testing.tiny_lm import MLP_PLAN, PLAN, TinyConfig, TinyLM, TinyMLP, make_batch

SEED = 1234
CONFIG = TinyConfig()
BATCH = 2


def assert_close(actual, expected, name="", tol=1e-5):
    error = max_relative_error(actual, expected)
    assert error <= tol, f"{name}: relative error {error:.2e} > {tol:.0e}"


def full_gradients(model, groups):
    """Every parameter's gradient as one process would see it (shards gathered, partial sums summed)."""
    from mega.core.parallel.collectives import all_reduce
    from mega.core.parallel.param_attrs import is_sequence_parallel
    from mega.testing.equivalence import full_tensor

    grads = {}
    for name, param in model.named_parameters():
        grad = full_tensor(param.grad, param, groups)
        if is_sequence_parallel(param):
            all_reduce(grad, groups.tp)
        grads[name] = grad
    return grads


# ------------------------------------------------------------------ whole model: tiny LM and MLP


def tiny_lm_step(tp, sequence_parallel):
    groups = ParallelGroups(ParallelConfig(tp=tp, sequence_parallel=sequence_parallel))
    torch.manual_seed(SEED)
    model = apply_tensor_parallel(TinyLM(CONFIG), PLAN, groups)
    tokens, labels = make_batch(CONFIG, BATCH, SEED)
    loss = model(tokens, labels, groups.tp)
    loss.backward()
    local_heads = model.layers[0].linear_qkv.weight.shape[0] // (4 * 4) * 2
    return loss.item(), full_gradients(model, groups), local_heads


@pytest.fixture(scope="module")
def tiny_lm_reference():
    groups = ParallelGroups(ParallelConfig())
    torch.manual_seed(SEED)
    model = TinyLM(CONFIG)
    tokens, labels = make_batch(CONFIG, BATCH, SEED)
    loss = model(tokens, labels, groups.tp)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("tp,sequence_parallel", [(2, False), (2, True), (4, False), (4, True)])
def test_tiny_lm_matches_one_process(worlds, tiny_lm_reference, tp, sequence_parallel):
    ref_loss, ref_grads = tiny_lm_reference
    for rank, (loss, grads, local_heads) in enumerate(worlds.run(tp, tiny_lm_step, tp, sequence_parallel)):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (rank, loss, ref_loss)
        assert local_heads == CONFIG.heads // tp
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert_close(grad, ref_grads[name], f"rank {rank} {name}")


def mlp_step(tp, sequence_parallel):
    from mega.core.parallel.collectives import (
        gather_from_sequence_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    groups = ParallelGroups(ParallelConfig(tp=tp, sequence_parallel=sequence_parallel))
    torch.manual_seed(SEED)
    model = apply_tensor_parallel(TinyMLP(), MLP_PLAN, groups)
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(SEED), requires_grad=True)
    inputs = scatter_to_sequence_parallel_region(x, groups.tp) if sequence_parallel else x
    out = model(inputs)
    if sequence_parallel:
        out = gather_from_sequence_parallel_region(out, groups.tp, tensor_parallel_output_grad=False)
    loss = (out**2).mean()
    loss.backward()
    return out.detach(), full_gradients(model, groups), x.grad


@pytest.mark.parametrize("tp,sequence_parallel", [(2, False), (2, True), (4, False), (4, True)])
def test_mlp_matches_one_process(worlds, tp, sequence_parallel):
    torch.manual_seed(SEED)
    model = TinyMLP()
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(SEED), requires_grad=True)
    out = model(x)
    (out**2).mean().backward()
    for parallel_out, grads, x_grad in worlds.run(tp, mlp_step, tp, sequence_parallel):
        assert_close(parallel_out, out.detach(), "output")
        assert_close(x_grad, x.grad, "input grad")
        for name, param in model.named_parameters():
            assert_close(grads[name], param.grad, name)


# ------------------------------------------------------------------ collectives, one by one


def collectives_check():
    import torch.distributed as dist

    from mega.core.parallel import collectives as c

    groups = ParallelGroups(ParallelConfig(tp=2))
    tp, rank = groups.tp, groups.tp.rank
    out = {}

    def run(fn, x, grad_seed):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        grad = torch.full_like(y, float(grad_seed + rank))  # differs per rank: shows what backward sums
        y.backward(grad)
        return y.detach(), x.grad

    base = torch.arange(8.0).view(4, 2) + 10 * rank  # differs per rank
    out["copy"] = run(lambda x: c.copy_to_tensor_parallel_region(x, tp), base, 1)
    out["reduce"] = run(lambda x: c.reduce_from_tensor_parallel_region(x, tp), base, 1)
    out["gather"] = run(lambda x: c.gather_from_tensor_parallel_region(x, tp), base, 1)
    out["sp_scatter"] = run(lambda x: c.scatter_to_sequence_parallel_region(x, tp), base, 1)
    out["sp_gather"] = run(lambda x: c.gather_from_sequence_parallel_region(x, tp), base, 1)
    out["sp_gather_split"] = run(
        lambda x: c.gather_from_sequence_parallel_region(x, tp, tensor_parallel_output_grad=False), base, 1)
    out["sp_reduce_scatter"] = run(lambda x: c.reduce_scatter_to_sequence_parallel_region(x, tp), base, 1)
    # Uneven all-to-all: rank 0 sends 1 row to itself and 3 to rank 1; rank 1 sends 2 and 2.
    sends = [[1, 3], [2, 2]]
    receives = [[sends[0][rank], sends[1][rank]]]
    x = torch.arange(4.0).unsqueeze(1) + 100 * rank
    out["all_to_all"] = run(lambda t: c.all_to_all(t, tp, receives[0], sends[rank]), x, 1)
    assert dist.get_world_size() == 2
    return out


def test_collectives_forward_and_backward(worlds):
    results = worlds.run(2, collectives_check)
    base = [torch.arange(8.0).view(4, 2) + 10 * r for r in range(2)]
    full_sum = base[0] + base[1]
    grad_sum = torch.full((4, 2), 1.0 + 2.0)  # grads 1 and 2 summed
    for rank, out in enumerate(results):
        g = float(1 + rank)
        y, dx = out["copy"]
        assert torch.equal(y, base[rank]) and torch.equal(dx, grad_sum)
        y, dx = out["reduce"]
        assert torch.equal(y, full_sum) and torch.equal(dx, torch.full((4, 2), g))
        y, dx = out["gather"]
        assert torch.equal(y, torch.cat(base, dim=1)) and torch.equal(dx, torch.full((4, 2), g))
        y, dx = out["sp_scatter"]
        assert torch.equal(y, base[rank][2 * rank:2 * rank + 2])
        assert torch.equal(dx, torch.tensor([[1.0, 1.0]] * 2 + [[2.0, 2.0]] * 2))
        y, dx = out["sp_gather"]
        assert torch.equal(y, torch.cat(base, dim=0)) and torch.equal(dx, grad_sum)
        y, dx = out["sp_gather_split"]
        assert torch.equal(dx, torch.full((4, 2), g))
        y, dx = out["sp_reduce_scatter"]
        assert torch.equal(y, full_sum[2 * rank:2 * rank + 2])
        assert torch.equal(dx, torch.tensor([[1.0, 1.0]] * 2 + [[2.0, 2.0]] * 2))
    (y0, dx0), (y1, dx1) = results[0]["all_to_all"], results[1]["all_to_all"]
    assert y0.view(-1).tolist() == [0.0, 100.0, 101.0] and y1.view(-1).tolist() == [1.0, 2.0, 3.0, 102.0, 103.0]
    # Gradients go back where the rows came from: rank 0's rows were read by ranks [0, 1, 1, 1].
    assert dx0.view(-1).tolist() == [1.0, 2.0, 2.0, 2.0] and dx1.view(-1).tolist() == [1.0, 1.0, 2.0, 2.0]


# ------------------------------------------------------------------ layers, init, cross-entropy


def layers_check():
    from mega.core.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    groups = ParallelGroups(ParallelConfig(tp=2))
    tp, rank = groups.tp, groups.tp.rank
    # Layout-independent initialisation: the same seed draws the same full weights.
    torch.manual_seed(7)
    column = ColumnParallelLinear(6, 8, tp, gather_output=True)
    torch.manual_seed(7)
    row = RowParallelLinear(8, 6, tp)
    torch.manual_seed(7)
    embedding = VocabParallelEmbedding(10, 4, tp)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0, 4, 5, 9]])
    errors = []
    for build in (lambda: ColumnParallelLinear(6, 7, tp), lambda: VocabParallelEmbedding(9, 4, tp),
                  lambda: ColumnParallelLinear(6, 12, tp, chunks=4),
                  lambda: ColumnParallelLinear(6, 8, tp, chunks=2, gather_output=True)):
        try:
            build()
        except ValueError as error:
            errors.append(str(error))
    return {
        "column": (column.weight.detach(), column.bias.detach(), column(x).detach()),
        "row": (row.weight.detach(), row(x.new_ones(3, 4) * (rank + 1)).detach()),
        "embedding": (embedding.weight.detach(), embedding(ids).detach()),
        "errors": errors,
    }


def test_layers_initialise_like_one_device_and_compute_the_same(worlds):
    torch.manual_seed(7)
    linear = nn.Linear(6, 8)
    torch.manual_seed(7)
    row_linear = nn.Linear(8, 6)
    torch.manual_seed(7)
    table = nn.Embedding(10, 4)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    row_input = torch.cat([torch.ones(3, 4), 2 * torch.ones(3, 4)], dim=1)
    for rank, out in enumerate(worlds.run(2, layers_check)):
        weight, bias, y = out["column"]
        assert torch.equal(weight, linear.weight.detach()[4 * rank:4 * rank + 4])
        assert torch.equal(bias, linear.bias.detach()[4 * rank:4 * rank + 4])
        assert_close(y, linear(x).detach(), "column output")
        weight, y = out["row"]
        assert torch.equal(weight, row_linear.weight.detach()[:, 4 * rank:4 * rank + 4])
        assert_close(y, row_linear(row_input).detach(), "row output")
        weight, y = out["embedding"]
        assert torch.equal(weight, table.weight.detach()[5 * rank:5 * rank + 5])
        assert torch.equal(y, table(torch.tensor([[0, 4, 5, 9]])).detach())
        messages = out["errors"]
        assert len(messages) == 4
        assert "output features 7 cannot be split over tensor-parallel size 2" in messages[0]
        assert "vocabulary size 9 is not divisible by tensor-parallel size 2" in messages[1]
        assert "output features 12 cannot be split in 4 blocks" in messages[2]
        assert "gather_output with chunks > 1" in messages[3]


# (label smoothing, real vocabulary rows of 16): no padding, padding inside rank 1's shard, and
# a rank 1 holding padding only.
CROSS_ENTROPY_CASES = [(0.0, 16), (0.1, 16), (0.0, 11), (0.1, 11), (0.1, 7)]


def cross_entropy_inputs():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 3, 16, generator=generator) * 4
    target = torch.randint(0, 7, (5, 3), generator=generator)
    return logits, target, torch.rand(5, 3, generator=generator)


def cross_entropy_check():
    from mega.core.parallel.collectives import split_along

    groups = ParallelGroups(ParallelConfig(tp=2))
    logits, target, weights = cross_entropy_inputs()
    results = []
    for label_smoothing, vocab_size in CROSS_ENTROPY_CASES:
        shard = split_along(logits, groups.tp, -1).requires_grad_(True)
        loss = vocab_parallel_cross_entropy(shard, target, groups.tp, label_smoothing, vocab_size)
        (loss * weights).sum().backward()
        results.append((loss.detach(), shard.grad))
    return results


def test_vocab_parallel_cross_entropy_matches_torch_over_the_real_vocabulary(worlds):
    """Padded rows (from vocab_size on) take no part: the loss is torch's over the real rows
    only, at tp2 and in one process, and the padded logits get no gradient."""
    logits, target, weights = cross_entropy_inputs()
    expected = []
    for label_smoothing, vocab_size in CROSS_ENTROPY_CASES:
        real = logits[..., :vocab_size].clone().requires_grad_(True)
        loss = F.cross_entropy(real.view(-1, vocab_size), target.view(-1), reduction="none",
                               label_smoothing=label_smoothing).view(5, 3)
        (loss * weights).sum().backward()
        grad = torch.cat([real.grad, torch.zeros(5, 3, 16 - vocab_size)], dim=-1)
        expected.append((loss.detach(), grad))

        whole = logits.clone().requires_grad_(True)
        one_process = cross_entropy(whole, target, None, vocab_size, label_smoothing)
        (one_process * weights).sum().backward()
        assert_close(one_process.detach(), loss.detach(), "one-process loss")
        assert_close(whole.grad, grad, "one-process grad")
    for rank, results in enumerate(worlds.run(2, cross_entropy_check)):
        for (parallel_loss, grad), (loss, full_grad), case in zip(results, expected, CROSS_ENTROPY_CASES, strict=True):
            assert_close(parallel_loss, loss, f"loss {case}")
            assert_close(grad, full_grad[..., 8 * rank:8 * rank + 8], f"grad {case}")


def test_cross_entropy_is_stable_for_huge_logits_on_one_process():
    groups = ParallelGroups(ParallelConfig())
    logits = torch.tensor([[1e4, -1e4, 0.0], [5e3, 5e3, 5e3]], requires_grad=True)
    target = torch.tensor([0, 2])
    loss = vocab_parallel_cross_entropy(logits, target, groups.tp, label_smoothing=0.2)
    loss.sum().backward()
    expected = F.cross_entropy(logits.detach(), target, reduction="none", label_smoothing=0.2)
    assert torch.isfinite(loss).all() and torch.isfinite(logits.grad).all()
    assert_close(loss.detach(), expected, "loss")


# ------------------------------------------------------------------ plan application


def plan_check():
    from mega.core.parallel.plan import Colwise, Rowwise, VocabEmbedding

    groups = ParallelGroups(ParallelConfig(tp=2))
    errors = {}

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    tied = apply_tensor_parallel(Tied(), {"embed": VocabEmbedding(), "head": Colwise()}, groups)
    for label, plan in [("type", {"embed": Rowwise()}), ("broken tie", {"embed": VocabEmbedding()})]:
        try:
            apply_tensor_parallel(Tied(), plan, groups)
        except (TypeError, ValueError) as error:
            errors[label] = str(error)
    return tied.head.weight is tied.embed.weight, tuple(tied.embed.weight.shape), errors


def test_apply_tensor_parallel_keeps_ties_and_explains_mistakes(worlds):
    for still_tied, shape, errors in worlds.run(2, plan_check):
        assert still_tied and shape == (4, 4)
        assert "plan style Rowwise for 'embed' needs an Linear, found Embedding" in errors["type"]
        assert "'head.weight' is tied to a weight the plan split" in errors["broken tie"]
    with pytest.raises(ValueError, match="pattern 'layers.\\*.linear_qkvv' matches no module of TinyLM"):
        apply_tensor_parallel(TinyLM(CONFIG), {"layers.*.linear_qkvv": PLAN["layers.*.linear_qkv"]},
                              ParallelGroups(ParallelConfig()))


# ------------------------------------------------------------------ RNG streams


def rng_check():
    from mega.core.parallel.random import MODEL_PARALLEL, parallel_seeds, seed_parallel_rng

    groups = ParallelGroups(ParallelConfig(tp=2, pp=2))
    tracker = seed_parallel_rng(42, groups)
    default_mask = F.dropout(torch.ones(64), 0.5)
    with tracker.fork(MODEL_PARALLEL):
        parallel_mask = F.dropout(torch.ones(64), 0.5)
    with tracker.fork():
        second_parallel_mask = F.dropout(torch.ones(64), 0.5)  # the stream advanced
    after_fork = F.dropout(torch.ones(64), 0.5)  # the default stream did not see the forks
    torch.manual_seed(parallel_seeds(42, groups)["default"])
    F.dropout(torch.ones(64), 0.5)
    undisturbed = torch.equal(after_fork, F.dropout(torch.ones(64), 0.5))
    return (parallel_seeds(42, groups), default_mask, parallel_mask,
            torch.equal(parallel_mask, second_parallel_mask), undisturbed)


def test_rng_streams_agree_and_differ_where_they_must(worlds):
    results = worlds.run(4, rng_check)  # tp=2, pp=2: ranks 0,1 are stage 0; 2,3 stage 1
    for rank, (seeds, _, _, repeated, undisturbed) in enumerate(results):
        tp_rank, pp_rank = rank % 2, rank // 2
        assert seeds["default"] == 42 + 100 * pp_rank
        assert seeds["model-parallel"] == 42 + 100 * pp_rank + 2718 + tp_rank
        assert not repeated and undisturbed
    default = [r[1] for r in results]
    parallel = [r[2] for r in results]
    assert torch.equal(default[0], default[1]) and torch.equal(default[2], default[3])  # same across tp
    assert not torch.equal(default[0], default[2])  # pipeline stages differ
    assert not torch.equal(parallel[0], parallel[1])  # tensor-parallel shards differ
    assert not torch.equal(parallel[0], default[0])
