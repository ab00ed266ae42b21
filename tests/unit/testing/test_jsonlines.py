"""`JsonLines`: a growing log read incrementally gives what reading it whole gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unbroken.testing.cluster import JsonLines


def append(path: Path, text: str) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(text)


def test_lines_appended_between_reads_are_each_parsed_once(tmp_path: Path) -> None:
    path = tmp_path / "n1.jsonl"
    seen: list[int] = []
    log = JsonLines(path, lambda item: seen.append(item["step"]) or item)
    assert log.read() == []  # not written yet
    append(path, '{"step": 1}\n{"step": 2}\n')
    assert [e["step"] for e in log.read()] == [1, 2]
    append(path, '{"step": 3}\n')
    assert [e["step"] for e in log.read()] == [1, 2, 3]
    assert seen == [1, 2, 3]


def test_a_line_cut_short_is_left_out_and_a_finished_one_counted(tmp_path: Path) -> None:
    path = tmp_path / "n1.jsonl"
    log = JsonLines(path)
    append(path, '{"step": 1}\n{"st')
    assert log.read() == [{"step": 1}]
    append(path, 'ep": 2}')  # whole but its newline not yet written
    assert log.read() == [{"step": 1}, {"step": 2}]
    append(path, '\n{"step": 3}\n')
    assert log.read() == [{"step": 1}, {"step": 2}, {"step": 3}]
    # A writer killed mid-line, then one appending after it: the joined line is no entry.
    append(path, '{"step": 4, "kind"{"step": 5}\n{"step": 6}\n')
    assert [e["step"] for e in log.read()] == [1, 2, 3, 6]


def test_a_replaced_or_truncated_log_is_read_from_its_start(tmp_path: Path) -> None:
    path = tmp_path / "n1.jsonl"
    log = JsonLines(path)
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)))
    assert len(log.read()) == 5
    path.write_text('{"step": 9}\n')  # truncated in place
    assert log.read() == [{"step": 9}]
    fresh = tmp_path / "other.jsonl"
    fresh.write_text('{"step": 7}\n{"step": 8}\n')
    fresh.replace(path)  # another file under the name
    assert log.read() == [{"step": 7}, {"step": 8}]
    path.unlink()
    assert log.read() == []


def test_what_the_conversion_refuses_fails_every_read_until_it_is_gone(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"

    def known(item: dict[str, str]) -> dict[str, str]:
        if item["kind"] != "commit":
            raise ValueError(f"no kind {item['kind']!r}")
        return item

    log = JsonLines(path, known)
    path.write_text('{"kind": "commit"}\n{"kind": "novel"}\n')
    for _ in range(2):
        with pytest.raises(ValueError, match="novel"):
            log.read()
    path.write_text('{"kind": "commit"}\n')
    assert log.read() == [{"kind": "commit"}]
