"""Scheduling decisions as pure functions: shares of the global batch."""

from unbroken.sched.shares import split_batch

__all__ = ["split_batch"]
