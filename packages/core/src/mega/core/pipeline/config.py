"""``PipelineConfig``: the pipeline schedule and how the layers are laid out over the stages.

The layout flags are Megatron-LM's (see :mod:`mega.core.pipeline.layout` for their meaning);
``--pipeline-schedule`` picks an entry of the schedule table
(:mod:`mega.core.pipeline.schedule_table`, :mod:`mega.core.pipeline.zero_bubble`;
docs/pipeline.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from mega.core.config.options import option
from mega.core.pipeline.schedule_table import SCHEDULES


@dataclass
class PipelineConfig:
    pipeline_schedule: str = option(
        "1f1b", "the pipeline schedule: 1f1b (interleaved 1F1B with virtual stages); zb-h1 (zero bubble: each "
        "backward split into an input-gradient step B and a weight-gradient step W that fills the bubble, "
        "1F1B's activation memory; interleaved zero bubble with virtual stages); zbv, dualpipev (two model "
        "chunks per rank in a V, the loss on the first rank; untied embeddings); see docs/pipeline.md",
        choices=SCHEDULES)
    decoder_first_pipeline_num_layers: int | None = option(
        None, "transformer layers on the first pipeline stage (the others split the rest evenly)")
    decoder_last_pipeline_num_layers: int | None = option(
        None, "transformer layers on the last pipeline stage (the others split the rest evenly)")
    account_for_embedding_in_pipeline_split: bool = option(
        False, "count the embedding as one layer when splitting the layers evenly: the first stage holds one "
        "transformer layer fewer")
    account_for_loss_in_pipeline_split: bool = option(
        False, "count the output layer and loss as one layer when splitting the layers evenly: the last stage "
        "holds one transformer layer fewer")
    pipeline_model_parallel_layout: str | None = option(
        None, "the layers of every virtual stage, Megatron's grammar: stages split by '|', E the embedding, "
        "t a transformer layer, L the loss, (..)*n and x*n repeat, commas are ignored; e.g. "
        "\"Et*3|(tt|)*29,m|L\" (pp*vpp stages; sets the virtual stages per rank)")

    def __post_init__(self) -> None:
        if self.pipeline_schedule not in SCHEDULES:
            raise ValueError(f"--pipeline-schedule {self.pipeline_schedule!r}: choose one of {', '.join(SCHEDULES)}")
        for flag, value in (("--decoder-first-pipeline-num-layers", self.decoder_first_pipeline_num_layers),
                            ("--decoder-last-pipeline-num-layers", self.decoder_last_pipeline_num_layers)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{flag} must be a non-negative integer, got {value!r}")
        uneven = self.decoder_first_pipeline_num_layers is not None or self.decoder_last_pipeline_num_layers is not None
        accounts = self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split
        if self.pipeline_model_parallel_layout is not None and (uneven or accounts):
            raise ValueError("--pipeline-model-parallel-layout places every layer itself: it cannot be combined with "
                             "--decoder-first/last-pipeline-num-layers or --account-for-embedding/loss-in-pipeline-split")
        if uneven and accounts:  # as Megatron: no standalone embedding or loss stage with uneven first/last
            raise ValueError("--decoder-first/last-pipeline-num-layers cannot be combined with "
                             "--account-for-embedding/loss-in-pipeline-split")
