"""Abortable waits: what ends a wait is raised with where the node was."""

from __future__ import annotations

import threading

import pytest

from unbroken.comm.group import EpochScope, wait_until
from unbroken.errors import CollectiveFailed, EpochAborted, Expelled, Where


def test_an_expelled_node_leaves_the_wait_with_expelled_and_where_it_was() -> None:
    expelled = Expelled("expelled: lease expired after 1.02 s", where=Where(epoch=4, step=17, rank=2))
    with pytest.raises(Expelled) as info:
        wait_until(lambda: False, EpochScope(threading.Event(), lambda: expelled, 5.0), "all-reduce of step 17")
    said = "all-reduce of step 17 abandoned: expelled: lease expired after 1.02 s [epoch 4, step 17, rank 2]"
    assert str(info.value) == said
    assert info.value.where == Where(epoch=4, step=17, rank=2)


def test_a_newer_epoch_ends_the_wait_with_epoch_aborted() -> None:
    order = EpochAborted("epoch 5 ordered: n2 failed", where=Where(epoch=4, step=9))
    with pytest.raises(EpochAborted) as info:
        wait_until(lambda: False, EpochScope(threading.Event(), lambda: order, 5.0), "state transfer")
    assert type(info.value) is EpochAborted and info.value.where == Where(epoch=4, step=9)
    with pytest.raises(EpochAborted, match=r"^build abandoned: donor gone$"):
        wait_until(lambda: False, EpochScope(threading.Event(), lambda: EpochAborted("donor gone"), 5.0), "build")


def test_the_deadline_is_a_collective_failure_and_done_wins() -> None:
    with pytest.raises(CollectiveFailed, match=r"ran past its 0\.05 s deadline"):
        wait_until(lambda: False, EpochScope(threading.Event(), lambda: None, 0.05), "all-reduce")
    wait_until(lambda: True, EpochScope(threading.Event(), lambda: Expelled("expelled"), 5.0), "all-reduce")
