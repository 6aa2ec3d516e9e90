"""Data parallelism: gradient buffers, buckets and the DDP wrapper the schedules drive."""

from mega.core.distributed.ddp import DDPConfig, DistributedDataParallel
from mega.core.distributed.grad_buffer import Bucket, GradBuffer

__all__ = ["Bucket", "DDPConfig", "DistributedDataParallel", "GradBuffer"]
