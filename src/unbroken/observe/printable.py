"""Text from peers, made safe for a terminal.

Member names, device names and event reasons come from the nodes; an ESC sequence in one of
them, printed raw, would drive the operator's terminal (retitle it, hide or fake lines,
on some terminals write to the clipboard). Wherever such text reaches a terminal —
``unbroken status``, ``unbroken events``, the log lines — its unprintable characters are
written as Python's ``repr`` writes them (``\\x1b``, ``\\n``, ``\\u202e``): still readable,
never obeyed. Printable Unicode (accents, CJK, emoji) is kept as it is.
"""

from __future__ import annotations

import logging
from types import TracebackType

ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]


def printable(text: str, keep: str = "") -> str:
    """``text`` with every character that `str.isprintable` refuses (C0 and C1 controls,
    ESC, DEL, bidirectional overrides, line separators...) escaped as ``repr`` does, except
    those in ``keep`` (``"\\n"`` for a traceback's lines)."""
    if text.isprintable():  # the common case, at C speed
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


class Formatter(logging.Formatter):
    """Log lines whose message (which may quote what a peer said) cannot drive a terminal,
    nor forge a log line of its own with a newline; a traceback keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))

    def formatException(self, ei: ExcInfo) -> str:
        return printable(super().formatException(ei), keep="\n")

    def formatStack(self, stack_info: str) -> str:
        return printable(super().formatStack(stack_info), keep="\n")
