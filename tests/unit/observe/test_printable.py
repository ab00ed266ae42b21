"""Peer text reaches a terminal escaped: control characters written as ``repr`` writes them,
printable Unicode as it is."""

from __future__ import annotations

import io
import logging

from unbroken.observe.printable import Formatter, printable


def test_control_characters_are_escaped_and_printable_unicode_kept() -> None:
    assert printable("gpu-0 été 東京 🚀") == "gpu-0 été 東京 🚀"
    assert printable("a\x1b[31mb") == "a\\x1b[31mb"  # C0: ESC
    assert printable("\x00\x07\x08\t\r\n\x7f") == "\\x00\\x07\\x08\\t\\r\\n\\x7f"  # C0 and DEL
    assert printable("\x9b2J\x85") == "\\x9b2J\\x85"  # C1: CSI, NEL
    assert printable("abc\u202edef") == "abc\\u202edef"  # a bidirectional override
    assert printable("one\ntwo\x1b", keep="\n") == "one\ntwo\\x1b"


def test_log_lines_carry_peer_text_escaped_and_tracebacks_keep_their_lines() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(Formatter("%(levelname)s %(message)s"))
    log = logging.getLogger("unbroken.test-printable")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("refused %s: %s", "ev\x1b]0;owned\x07il", "bye\nWARNING forged")
        try:
            raise ValueError("boom\x1b[2J")
        except ValueError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines[0] == "WARNING refused ev\\x1b]0;owned\\x07il: bye\\nWARNING forged"
    assert lines[1] == "ERROR failed" and lines[2].startswith("Traceback")
    assert lines[-1] == "ValueError: boom\\x1b[2J"
    assert "\x1b" not in out.getvalue()
