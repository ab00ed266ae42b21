"""Streams read in order: any positions, forward cheaply, wrapping around a finite source."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset

from unbroken.errors import ConfigError
from unbroken.job import Job
from unbroken.train.stream import IterableStream, ShardStream, StreamPlan


class Counting(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n, self.iterations = n, 0

    def __iter__(self) -> Iterator[int]:
        self.iterations += 1
        return iter(range(self.n))


def test_an_iterable_is_read_at_any_positions_and_wraps_around() -> None:
    source = Counting(10)
    stream = IterableStream(source)
    stream.HEAD = 0  # no kept head: every backward read starts over
    begun = source.iterations
    assert stream.read(0, 4) == [0, 1, 2, 3]
    assert stream.read(6, 3) == [6, 7, 8], "forward: the samples between are skipped"
    assert source.iterations == begun + 1
    assert stream.read(2, 2) == [2, 3], "backward (a retried step): read again from the start"
    assert source.iterations == begun + 2
    assert stream.read(8, 5) == [8, 9, 0, 1, 2], "a finite stream starts over"
    assert stream.read(23, 2) == [3, 4], "positions past the end wrap once its length is known"


def test_the_first_samples_are_kept_for_speed_probes() -> None:
    source = Counting(1000)
    stream = IterableStream(source)
    assert stream.read(500, 2) == [500, 501]
    begun = source.iterations
    assert stream.read(0, 8) == list(range(8)), "a probe of the first samples"
    assert stream.read(502, 1) == [502] and source.iterations == begun, "training goes on where it was"


def test_a_one_shot_iterator_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"one-shot iterator .*a retried step must read its samples again"):
        IterableStream(iter(range(5)))


def test_an_empty_iterable_is_named() -> None:
    with pytest.raises(ConfigError, match="yielded no samples"):
        IterableStream(Counting(0), name="nothing").read(0, 1)


def write(directory: Path, shards: dict[str, list[object]], trailing_newline: bool = True) -> None:
    directory.mkdir()
    for name, rows in shards.items():
        text = "\n".join(json.dumps(r) for r in rows)
        (directory / name).write_text(text + ("\n" if trailing_newline and rows else ""))


def test_shards_are_read_by_seeking_across_files_in_name_order(tmp_path: Path) -> None:
    write(tmp_path / "d", {"b.jsonl": [3, 4, 5], "a.jsonl": [0, 1, 2], "c.jsonl": [], "d.jsonl": [6]})
    stream = ShardStream(tmp_path / "d", "*.jsonl", decode=json.loads)
    assert stream.length == 7
    assert stream.read(2, 6) == [2, 3, 4, 5, 6, 0], "across shards, an empty one, and around"
    assert stream.read(15, 2) == [1, 2]
    assert stream.read(0, 1) == [0]


def test_a_shard_without_a_final_newline_and_the_identity(tmp_path: Path) -> None:
    write(tmp_path / "d", {"a.jsonl": [0, 1]}, trailing_newline=False)
    stream = ShardStream(tmp_path / "d", decode=json.loads)
    assert stream.read(0, 3) == [0, 1, 0]
    before = stream.identity()
    (tmp_path / "d" / "a.jsonl").write_text("0\n1\n2\n")
    assert ShardStream(tmp_path / "d", decode=json.loads).identity() != before, "other data: another job"


def test_no_shards_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(ConfigError, match=r"no shard matches '\*.txt' in .*: check the directory and pattern"):
        ShardStream(tmp_path / "d", "*.txt")


def test_a_stream_plan_gives_each_slice_its_positions() -> None:
    plan = StreamPlan(8)
    assert plan.indices(3, 2, 4) == [26, 27, 28, 29]
    with pytest.raises(ValueError, match="outside a batch"):
        plan.indices(0, 6, 4)


def job(dataset: object) -> Job:
    return Job(
        name="s", model=lambda: nn.Linear(1, 1), optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        dataset=dataset, loss=nn.functional.mse_loss, batch_size=4, num_steps=2,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_job_reads_a_stream_by_position_and_names_a_bare_iterable_dataset() -> None:
    j = job(IterableStream(Counting(10), name="count"))
    assert j.samples(j.plan().indices(2, 1, 3)) == [9, 0, 1]
    assert j.samples([4, 5, 8]) == [4, 5, 8], "runs of consecutive positions"
    assert j.num_samples == 0 and j.identity() != job(IterableStream(Counting(10), name="other")).identity()
    with pytest.raises(ConfigError, match=r"read it as a stream, dataset=IterableStream\(it\)"):
        job(Counting(10))
