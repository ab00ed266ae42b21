"""The data plan (which samples each step consumes, whoever computes them), as the training
loop takes them: defined with the job that describes it (`unbroken.job`), which the training
loop builds on: the job imports nothing of train."""

from unbroken.job.data import (
    KEPT,
    DataPlan,
    LoaderOrder,
    PassOrder,
    order_digest,
)

__all__ = [
    "KEPT",
    "DataPlan",
    "LoaderOrder",
    "PassOrder",
    "order_digest",
]
