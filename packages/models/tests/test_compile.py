"""``torch.compile`` traces the transformer layers whole, and ``--compile`` trains as eager does.

The LLaMA layer once broke into 16 graphs (the rotary and SwiGLU autograd Functions wrote with
``out=`` into halves of one buffer, which dynamo cannot trace) and inductor failed on it. Here
dynamo must see each GPT and LLaMA layer as one graph, forward and backward, and a compiled
training run must give eager's losses. ``aot_eager`` runs the traced graphs without generating
code, which keeps the test fast; inductor's timings are in docs/benchmarks.md.
"""

from __future__ import annotations

import pytest
import torch

FAMILIES = {"gpt": ["--model-family", "gpt"], "llama": ["--model-family", "llama", "--num-query-groups", "2"]}
TINY = ["--mock-data", "--model-preset", "tiny", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "100", "--seed", "3"]


def parse(argv):
    from mega.train.command import parse_run

    return parse_run(argv)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layer_traces_as_one_graph_forward_and_backward(family):
    from mega.core.build import build_stage
    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.core.parallel.random import seed_parallel_rng

    # Without dropout: attention dropout forks Megatron's RNG tracker (torch.get_rng_state and
    # set_rng_state, which dynamo does not trace), so with dropout the graph breaks around it.
    run, model_family = parse(TINY + FAMILIES[family] + ["--hidden-dropout", "0", "--attention-dropout", "0"])
    tracker = seed_parallel_rng(3, ParallelGroups(ParallelConfig()))
    model = build_stage(model_family, run.model, rng_tracker=tracker)  # a training layer, as mega train builds it
    layer = model.decoder.layers["0"]
    hidden = torch.randn(16, 2, 32, requires_grad=True)

    explanation = torch._dynamo.explain(layer)(hidden)  # traces the autograd Functions' backwards too
    assert explanation.graph_break_count == 0, [str(b.reason)[:300] for b in explanation.break_reasons]
    assert explanation.graph_count == 1

    # and the whole graph, forward and backward, runs and gives eager's gradients
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    grads = []
    for module in (compiled, layer):
        x = hidden.detach().clone().requires_grad_()
        module(x).square().sum().backward()
        grads.append([x.grad] + [p.grad.clone() for p in layer.parameters()])
        layer.zero_grad(set_to_none=True)
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_compiled_training_matches_eager():
    from mega.train.launch_run import run_training

    argv = TINY + FAMILIES["llama"] + ["--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0"]
    eager = run_training(*parse(argv)).losses
    compiled_run, family = parse(argv + ["--compile", "--compile-backend", "aot_eager"])
    assert compiled_run.kernels.compile
    assert run_training(compiled_run, family).losses == pytest.approx(eager, rel=1e-5)


def test_compile_units_are_the_layers_and_names_stay():
    from mega.core.build import build_stage
    from mega.train.compile import compile_stage

    run, family = parse(TINY + FAMILIES["gpt"])
    model = build_stage(family, run.model)
    names = [name for name, _ in model.named_parameters()]
    compile_stage(family, model, "aot_eager")
    assert all(layer._compiled_call_impl is not None for layer in model.decoder.layers.values())
    assert [name for name, _ in model.named_parameters()] == names  # checkpoints see eager names


def test_compile_with_selective_recompute_is_refused_before_any_work():
    from mega.core.config import ConfigError
    from mega.train.run_config import derive

    run, _ = parse(TINY + FAMILIES["gpt"] + ["--compile", "--recompute-activations"])
    with pytest.raises(ConfigError, match="--compile with --recompute-granularity selective"):
        derive(run, 1)
