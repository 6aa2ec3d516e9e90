"""One ordered model setup (mega.core.setup_passes): the order in which passes are registered
never changes the model, and a third party's pass runs at the phase it declares.

CPU and gloo (pinned: every tensor on the CPU, a world of 2 gloo ranks), also on a GPU machine.
A tiny GPT at dp2 is set up by its family's passes (tensor plan, context parallelism,
recompute), the core's materialisation and the run's passes from the plugins (LoRA, torchao's
FP8, --compile with the eager backend, weight tying, FSDP2), plus a probe plugin's pass registered through
``register_setup_passes`` at phase RECOMPUTE. The passes are given once in the order the plugins
list them and once reversed: both models must hold the same parameters (by name, whole values
gathered from FSDP's shards), the same module types at every name (FSDP2 outermost, compiled
layers, FP8 layers inside the LoRA adapters) and compute the same logits; the probe must see
the adapters and the FP8 layers (ADAPTERS and PRECISION ran) and no compiled or sharded module
(COMPILE and DATA_PARALLEL did not yet).
"""

from __future__ import annotations

import torch

from mega.core.plugins import hookimpl

ARGV = ["--mock-data", "--model-family", "gpt", "--model-preset", "tiny", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "2", "--ffn-hidden-size", "64", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "64", "--make-vocab-size-divisible-by", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--seed", "5", "--lora-rank", "16", "--load", "unused", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise",
        "--compile", "--compile-backend", "eager", "--use-torch-fsdp2", "--recompute-granularity", "full",
        "--recompute-method", "uniform", "--recompute-num-layers", "1"]


class Probe:
    """A third-party pass: records what the chunks look like when it runs."""

    seen: list[dict] = []

    def __call__(self, chunk, setup):
        kinds = {type(module).__name__ for module in chunk.modules()}
        Probe.seen.append({"lora": "LoRALinear" in kinds, "fp8": "Float8Linear" in kinds,
                           "compiled": any(getattr(m, "_compiled_call_impl", None) is not None for m in chunk.modules()),
                           "sharded": any(name.startswith("FSDP") or name == "FullyShardedDataParallel" for name in kinds)})


class ProbePlugin:
    @hookimpl
    def register_setup_passes(self, register):
        from mega.core.setup_passes import Phase, per_chunk

        register("probe", lambda run_config: per_chunk("probe", Phase.RECOMPUTE, Probe()),
                 "records the chunks at phase RECOMPUTE")


def build(run, family, plugins, reverse: bool):
    from mega.core.build import MATERIALIZE, build_on_meta
    from mega.core.kernels import Kernels
    from mega.core.parallel import ParallelGroups
    from mega.core.parallel.random import seed_parallel_rng
    from mega.core.setup_passes import ModelSetup, registered_passes, run_setup

    groups = ParallelGroups(run.parallel)
    tracker = seed_parallel_rng(run.training.seed, groups)
    passes = [*registered_passes(plugins, run), *family.layout_passes(), MATERIALIZE]
    if reverse:
        passes.reverse()
    chunks = build_on_meta(family, run.model, [family.whole_model(run.model)], Kernels(), run.parallel)
    setup = ModelSetup(chunks, family, run.model, groups, run.parallel, tracker, True, groups.device,
                       torch.float32, run.training.seed, True, run)
    return [setup_pass.name for setup_pass in passes], run_setup(setup, passes)[0]


def describe(model) -> dict:
    from torch.distributed.tensor import DTensor

    tokens = torch.arange(32).remainder(64).view(2, 16)
    logits = model({"tokens": tokens})["logits"].detach()
    parameters = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                  for name, p in model.named_parameters()}
    types = {name: type(module).__name__ for name, module in model.named_modules()}
    compiled = sorted(name for name, module in model.named_modules() if module._compiled_call_impl is not None)
    return {"parameters": parameters, "types": types, "logits": logits, "compiled": compiled}


def two_orders() -> dict:
    from mega.core.plugins import load_plugins
    from mega.train.run_parser import parse_run

    # A device context, not set_default_device: a default left set is a torch-function mode under which
    # dynamo breaks the graphs of later tests in the same rank process.
    with torch.device("cpu"):
        run, family = parse_run(ARGV)
        plugins = load_plugins(extra=[("probe", ProbePlugin())])
        result = {}
        for reverse in (False, True):
            names, model = build(run, family, plugins, reverse)
            result[reverse] = {"names": names, "probe": list(Probe.seen), **describe(model)}
            Probe.seen.clear()
    return result


def test_registration_order_does_not_change_the_model(worlds):
    forward, backward = worlds.run(2, two_orders)[0].values()
    assert forward["names"] != backward["names"]  # the passes really came in two orders
    assert forward["types"] == backward["types"]
    types = forward["types"]
    assert types[""] == "FullyShardedDataParallel", types[""]  # data parallelism wraps last
    (qkv,) = [name for name in types if name.endswith("layers.0.self_attention.linear_qkv")]
    layer = qkv.removesuffix(".self_attention.linear_qkv")
    assert types[layer].startswith("FSDP"), types[layer]  # each layer an FSDP2 unit
    assert types[qkv] == "LoRALinear" and types[qkv + ".base"] == "Float8Linear"  # FP8 after the adapters
    assert types[qkv + ".adapter.linear_in"] == "Float8Linear", {n: t for n, t in types.items() if "adapter" in n}
    assert forward["compiled"] == backward["compiled"] == [layer.replace(".0", f".{n}") for n in range(2)]
    assert forward["parameters"].keys() == backward["parameters"].keys()
    for name, value in forward["parameters"].items():
        torch.testing.assert_close(backward["parameters"][name], value, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(backward["logits"], forward["logits"], rtol=0, atol=0)
    for run in (forward, backward):  # the third party's pass ran at RECOMPUTE, whatever its place in the list
        assert run["probe"] == [{"lora": True, "fp8": True, "compiled": False, "sharded": False}]
