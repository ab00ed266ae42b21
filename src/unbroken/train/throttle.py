"""Emulated slow devices (``unbroken node --throttle``), as the step loop takes them.

`Throttle` and `parse_throttle` are defined in `unbroken.specs`, with the other settings
parsed without torch: a `NodeConfig` checks its throttle there, and the configuration
imports nothing of the training loop.
"""

from unbroken.specs import Throttle, parse_throttle

__all__ = ["Throttle", "parse_throttle"]
