"""Streamed datasets, read in their own order, as the training loop takes them: defined with
the job that describes it (`unbroken.job`), which the training loop builds on: the job
imports nothing of train."""

from unbroken.job.stream import (
    IterableStream,
    ShardStream,
    Stream,
    StreamPlan,
)

__all__ = [
    "IterableStream",
    "ShardStream",
    "Stream",
    "StreamPlan",
]
