"""Pipeline parallelism: stage partitioning, the schedule table, p2p transfers and the schedules."""

from mega.core.pipeline.messages import check_exchanges, exchanges
from mega.core.pipeline.partition import PartitionError, pipeline_chunks, split_layers
from mega.core.pipeline.schedule_table import Action, ScheduleError, ScheduleTable, schedule_table
from mega.core.pipeline.schedules import GradSync, forward_backward
from mega.core.pipeline.tied import setup_tied_weights, sum_tied_grads, tie_across_stages, tied_parameters
from mega.core.pipeline.timeline import PipelineTimeline, timeline_callback

__all__ = [
    "Action",
    "GradSync",
    "PartitionError",
    "PipelineTimeline",
    "ScheduleError",
    "ScheduleTable",
    "check_exchanges",
    "exchanges",
    "forward_backward",
    "pipeline_chunks",
    "schedule_table",
    "split_layers",
    "setup_tied_weights",
    "sum_tied_grads",
    "tie_across_stages",
    "tied_parameters",
    "timeline_callback",
]
