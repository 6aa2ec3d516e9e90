"""Pipeline parallelism: stage partitioning and uneven layouts, the schedule table (1F1B, interleaved,
zero bubble), p2p transfers and the schedules' execution."""

from mega.core.pipeline.config import PipelineConfig
from mega.core.pipeline.layout import layers_per_stage, parse_layout
from mega.core.pipeline.messages import check_exchanges, exchanges
from mega.core.pipeline.partition import PartitionError, pipeline_chunks, split_layers
from mega.core.pipeline.schedule_table import SCHEDULES, Action, ScheduleError, ScheduleTable, schedule_table
from mega.core.pipeline.schedules import GradSync, forward_backward
from mega.core.pipeline.tied import setup_tied_weights, sum_tied_grads, tie_across_stages, tied_parameters

__all__ = [
    "Action",
    "GradSync",
    "PartitionError",
    "PipelineConfig",
    "SCHEDULES",
    "ScheduleError",
    "ScheduleTable",
    "check_exchanges",
    "exchanges",
    "forward_backward",
    "layers_per_stage",
    "parse_layout",
    "pipeline_chunks",
    "schedule_table",
    "split_layers",
    "setup_tied_weights",
    "sum_tied_grads",
    "tie_across_stages",
    "tied_parameters",
]
