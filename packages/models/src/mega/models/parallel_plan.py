"""Which layer of the transformer is split how under tensor parallelism: the one place that says it.

Megatron's split: QKV and fc1 column-parallel (whole query groups; SwiGLU's gate and up each
split on their own), the output projections row-parallel, the vocabulary split in the word
embeddings and the output layer; the sequence-parallel region starts after the embeddings.
"""

from __future__ import annotations

from mega.core.model_family import Stage
from mega.core.parallel.plan import (
    ColumnThenRow,
    Colwise,
    PlanStyle,
    Rowwise,
    SequenceParallelOutput,
    VocabEmbedding,
)
from mega.models.config import TransformerConfig

FC1, FC2, MLP = "decoder.layers.*.mlp.linear_fc1", "decoder.layers.*.mlp.linear_fc2", "decoder.layers.*.mlp"


def tensor_parallel_plan(config: TransformerConfig, stage: Stage) -> dict[str, PlanStyle]:
    """The plan for ``stage`` (naming only what it holds, so the plan is strict)."""
    pre_process, post_process = stage.is_first, stage.is_last
    plan: dict[str, PlanStyle] = {}
    tied = not config.untie_embeddings_and_output_weights
    if pre_process or (post_process and tied):  # the last stage's copy of a tied embedding too
        plan["embedding"] = SequenceParallelOutput()
        plan["embedding.word_embeddings"] = VocabEmbedding()
    if len(stage.layers["decoder"]):  # an uneven layout's first or last stage may hold no layer
        plan["decoder.layers.*.self_attention.linear_qkv"] = Colwise()
        plan["decoder.layers.*.self_attention.linear_proj"] = Rowwise()
        plan[FC1] = Colwise(chunks=2 if config.swiglu else 1)
        plan[FC2] = Rowwise()
    if post_process:
        plan["output_layer"] = Colwise()
    return plan


def with_fused_mlps(plan: dict[str, PlanStyle]) -> dict[str, PlanStyle]:
    """The plan for layers whose MLP is one module with fc1 and fc2 inside (a ``norm_mlp``
    kernel's): the module is split whole, fc1 as the plan splits fc1, fc2 as it splits fc2."""
    plan = dict(plan)
    fc1, fc2 = plan.pop(FC1), plan.pop(FC2)
    if not (isinstance(fc1, Colwise) and isinstance(fc2, Rowwise) and not fc1.gather_output):
        raise ValueError(f"a fused MLP is split column-then-row, not as {fc1} then {fc2}")
    plan[MLP] = ColumnThenRow(chunks=fc1.chunks)
    return plan
