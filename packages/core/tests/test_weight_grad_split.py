"""The backward split into B and W gives the unsplit backward's gradients, bit for bit, and the
data-parallel wrapper reduces a bucket once its last gradient is in, from B or from W.

The model is test_grad_accumulation_fusion's: mega's torch linear, a column- and a row-parallel
linear (tp 1) and a vocabulary weight tied to a linear layer. (The grouped MoE experts:
packages/models/tests/test_experts_weight_grad_split.py.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mega.core.distributed.ddp import DDPConfig, DistributedDataParallel
from mega.core.parallel import ParallelConfig, ParallelGroups
from mega.core.parallel.grad_accumulation_fusion import Linear
from mega.core.parallel.weight_grad_split import deferring_weight_grads, run_weight_grads
from mega.testing.peak_memory import peak_allocated_bytes

sys.path.insert(0, str(Path(__file__).parent))  # the model of the fusion test, beside this file
from test_grad_accumulation_fusion import Tiny  # noqa: E402


def _main_grads(fused: bool, split: bool, device: str):
    model = Tiny(torch.float32).to(device)
    ddp = DistributedDataParallel(model, ParallelGroups(ParallelConfig()),
                                  DDPConfig(bucket_size=1, overlap_grad_reduce=True,  # a bucket per parameter
                                            gradient_accumulation_fusion=fused))
    ddp.zero_grad_buffer()
    launched = {}
    for step in range(3):  # three micro-batches, the last one reducing
        ids = torch.randint(0, 24, (4, 5), generator=torch.Generator().manual_seed(step)).to(device)
        pending = []
        with ddp.no_sync() if step < 2 else torch.enable_grad():
            # The vocabulary weight's lookup gives it an ordinary gradient: its linear keeps it in B.
            with deferring_weight_grads(pending, [model.head.weight]) if split else torch.enable_grad():
                loss = ddp(ids).float().square().mean()
            loss.backward()
            launched["after B"] = _launched(ddp, model)
            run_weight_grads(pending)
            launched["after W"] = _launched(ddp, model)
    ddp.finish_grad_sync()
    return {name: p.main_grad.clone() for name, p in model.named_parameters()}, launched


def _launched(ddp, model) -> set[str]:
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)] for buffer in ddp.grad_buffers for bucket in buffer.buckets if bucket.grad_launched
            for p in bucket.params}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("fused", [False, True])
def test_split_backward_gives_the_unsplit_gradients_and_reduces_buckets_after_their_last_w(device, fused):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here")
    whole, whole_launched = _main_grads(fused, split=False, device=device)
    split, split_launched = _main_grads(fused, split=True, device=device)
    for name, grad in whole.items():
        assert torch.equal(split[name], grad), name
    everything = set(whole)
    assert whole_launched["after B"] == everything
    # The linears' weights and biases wait for W; the tied vocabulary weight and the row-parallel
    # bias (added after the layer's sum, by autograd) arrive in B.
    assert split_launched["after B"] == {"embedding.weight", "row.bias"}
    assert split_launched["after W"] == everything


def test_w_hands_each_gradient_over_once_after_its_last_product_and_frees_as_it_goes():
    """CPU. Four linears, one of them applied twice: each weight's hook fires once with the sum of
    its products (the unsplit gradient), and W, whose hooks move each gradient into a buffer as
    data parallelism does, holds at most a weight's running sum and its next product at once."""
    torch.manual_seed(0)
    layers = [Linear(256, 256, bias=False) for _ in range(4)]
    buffers = {id(layer.weight): torch.zeros(256, 256) for layer in layers}
    fired = []

    def move_to_buffer(param):
        fired.append(id(param))
        buffers[id(param)] += param.grad
        param.grad = None

    for layer in layers:
        layer.weight.register_post_accumulate_grad_hook(move_to_buffer)

    def forward(x):
        x = layers[1](layers[0](x))
        return layers[3](layers[2](layers[1](x)))  # layers[1] twice

    x = torch.randn(8, 256, requires_grad=True)  # as a stage's input: B's graph runs through it
    forward(x).square().sum().backward()
    whole = {key: buffer.clone() for key, buffer in buffers.items()}
    for buffer in buffers.values():
        buffer.zero_()
    fired.clear()
    pending = []
    with deferring_weight_grads(pending):
        y = forward(x)
    y.square().sum().backward()
    del y
    assert buffers[id(layers[0].weight)].count_nonzero() == 0  # all in W
    peak = peak_allocated_bytes(lambda: run_weight_grads(pending))
    assert sorted(fired) == sorted(buffers)  # once each
    for key, grad in whole.items():
        torch.testing.assert_close(buffers[key], grad, rtol=1e-6, atol=1e-6)
    weight_bytes = 256 * 256 * 4
    # layers[1]'s running sum and its next product: two; all of W's products at once: five
    assert peak < 3 * weight_bytes, f"W held {peak / weight_bytes:.1f} weight gradients at once"


def test_a_compiled_module_defers_its_linears_weight_gradients_too():  # device: cpu
    """Under ``torch.compile`` (aot_eager: dynamo's tracing, no code generation) mega's linears
    run eagerly between the compiled pieces while a deferring region is open, so W still gets
    their products (before, a compiled layer computed them in B and left W empty); outside a
    region the same compiled module takes its other graph and computes them in B."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(8, 16), torch.nn.GELU(), Linear(16, 8))
    compiled = torch.nn.Sequential(Linear(8, 16), torch.nn.GELU(), Linear(16, 8))
    compiled.load_state_dict(model.state_dict())
    compiled.compile(backend="aot_eager")
    x = torch.randn(4, 8, requires_grad=True)  # as a stage's input (the weights enter the deferring products detached)
    model(x).square().sum().backward()
    pending = []
    with deferring_weight_grads(pending):
        loss = compiled(x).square().sum()
    loss.backward()  # B
    assert len(pending) == 2 and all(p.grad is None for p in compiled.parameters())
    run_weight_grads(pending)  # W
    for expected, got in zip(model.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-6, atol=1e-6)
    compiled.zero_grad(set_to_none=True)
    compiled(x).square().sum().backward()  # no region open: the weight gradients come in B
    for expected, got in zip(model.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-6, atol=1e-6)
