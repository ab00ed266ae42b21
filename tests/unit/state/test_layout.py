"""The deterministic layout of a state tree, and the chunks the resync cuts it into."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from unbroken.comm.transfer import assign, chunk_digests, chunk_table
from unbroken.errors import TransferError
from unbroken.state import layout


def tree() -> dict[str, object]:
    return {
        "step": 3,
        "model": {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a": torch.zeros(0)},
        "opt": {"state": {0: {"step": torch.tensor(2.0)}}, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
        "rng": [1, 2, 3],
    }


def test_split_then_join_gives_the_tree_back_with_keys_in_one_order() -> None:
    header, tensors = layout.split(tree())
    header = json.loads(json.dumps(header))
    back = layout.join(header, tensors)
    assert back["opt"]["groups"][0]["betas"] == (0.9, 0.99) and back["opt"]["state"][0]["step"].item() == 2.0
    assert torch.equal(back["model"]["b"], tree()["model"]["b"]) and back["rng"] == [1, 2, 3]
    assert [s.path for s in layout.slots(header)] == ["/model/a", "/model/b", "/opt/state/0/step"]
    assert layout.split(dict(reversed(list(tree().items()))))[0] == layout.split(tree())[0]


@pytest.mark.parametrize(
    "header",
    [[], {"t": 0, "dtype": "nothing", "shape": [1]}, {"t": 0, "dtype": "float32", "shape": [-1]},
     {"l": [{"t": 1, "dtype": "float32", "shape": [1]}]}, {"d": [["x"]]}],
)  # fmt: skip
def test_a_malformed_header_is_refused(header: object) -> None:
    with pytest.raises(TransferError):
        layout.slots(header)


def test_chunks_stay_inside_one_tensor() -> None:
    table = chunk_table([10, 0, 25], chunk_bytes=8)
    assert [(c.tensor, c.start, c.end) for c in table] == [(0, 0, 8), (0, 8, 10), (2, 0, 8), (2, 8, 16), (2, 16, 24),
                                                          (2, 24, 25)]  # fmt: skip


def test_equal_chunks_have_equal_digests_and_a_changed_one_differs() -> None:
    a = [torch.arange(100, dtype=torch.float32), torch.ones(7)]
    b = [t.clone() for t in a]
    b[0][60] += 1
    table = chunk_table([t.numel() * 4 for t in a], chunk_bytes=64)
    da, db = chunk_digests(a, table), chunk_digests(b, table)
    assert [i for i in range(len(table)) if da[i] != db[i]] == [3]


@given(st.lists(st.integers(0, 999), unique=True, max_size=60), st.integers(1, 5), st.integers(0, 7))
def test_assign_spreads_chunks_evenly_and_loses_none(needed: list[int], n: int, offset: int) -> None:
    donors = list(range(10, 10 + n))
    asks = assign(needed, donors, offset)
    assert sorted(i for want in asks.values() for i in want) == sorted(needed)
    sizes = [len(w) for w in asks.values()]
    assert max(sizes) - min(sizes) <= 1
