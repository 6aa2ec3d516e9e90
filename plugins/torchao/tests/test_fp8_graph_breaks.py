"""Where dynamo breaks a compiled transformer layer's graph, bf16 and FP8 (device: CPU; dynamo
only traces here, nothing is generated for a GPU).

A break splits a layer into graphs that ``--compile`` cannot fuse across, which is where FP8's
casts and amax reductions stay separate kernels (issue 54: FP8 at 1.04x of bf16 instead of 1.3x).
GPT's and LLaMA's layers, with torchao's FP8 linears in them, trace as one graph (their bf16
layers: packages/models/tests/test_compile.py). A mixture-of-experts layer breaks where the
number of rows each expert receives becomes a host-side list: dropless routing makes that
count data (``nonzero`` of the kept slots, then ``counts.tolist()`` for the experts' grouped
products), as Megatron's grouped GEMM also takes its splits on the host. The router itself
(top-k, the load count, the auxiliary losses) stays in the graph.
"""

from __future__ import annotations

import pytest
import torch

TINY = ["--mock-data", "--model-preset", "tiny", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--hidden-dropout", "0", "--attention-dropout", "0"]
FAMILIES = {"gpt": ["--model-family", "gpt"], "llama": ["--model-family", "llama", "--num-query-groups", "2"],
            "mixtral": ["--model-family", "mixtral", "--num-query-groups", "2", "--num-experts", "4",
                        "--moe-router-topk", "2"]}
# The MoE layer's breaks, by the line of mega.models.moe.dispatch that makes them and why.
MOE_BREAKS = {"wanted.nonzero()": "the kept slots of the local experts: a data-dependent count",
              "counts.tolist()": "the rows per expert, handed to the grouped products on the host"}


def breaks_of_layer(family_name: str, fp8: bool) -> list[str]:
    """The source lines at which dynamo breaks layer 0's graph (empty: one graph)."""
    from mega_torchao.fp8 import apply_fp8, float8_config

    from mega.core.build import build_stage
    from mega.train.command import parse_run

    run, family = parse_run(TINY + FAMILIES[family_name])
    model = build_stage(family, run.model, device=torch.device("cpu"))
    if fp8:
        report = apply_fp8(model, float8_config("hybrid", "tensorwise"), num_layers=2)
        assert any(name.startswith("decoder.layers.0.") for name in report.fp8)  # really FP8 linears
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model.decoder.layers["0"])(torch.randn(16, 2, 32, requires_grad=True))
    return [str(reason.user_stack[-1].line) for reason in explanation.break_reasons]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_dense_layers_trace_as_one_graph_with_fp8_linears(family):
    assert breaks_of_layer(family, fp8=True) == []


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_moe_layers_break_only_where_expert_row_counts_reach_the_host(fp8):
    lines = breaks_of_layer("mixtral", fp8)
    assert lines, "the MoE layer traced whole: update MOE_BREAKS and the docstring"
    unexplained = [line for line in lines if not any(site in line for site in MOE_BREAKS)]
    assert unexplained == [], unexplained
