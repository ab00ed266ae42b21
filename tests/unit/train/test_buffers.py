"""Buffers travel as deltas in the step's all-reduce: an unchanged element stays what it
was, infinite included (an additive attention mask), and one member keeps its own values
bit for bit."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from jobs import mlp
from unbroken.job import Job
from unbroken.testing.inmemory import MemoryJob
from unbroken.testing.promises import reference_tree
from unbroken.train.runtime import NodeResult
from unbroken.train.step import add_deltas, write_deltas

pytestmark = pytest.mark.timeout(120)


def test_an_unchanged_infinite_element_is_a_zero_delta_and_stays_infinite() -> None:
    mask = torch.tensor([0.0, -torch.inf, torch.inf, -0.0])
    before = [mask.clone()]
    flat = torch.full((4,), 7.0)
    write_deltas(flat, 0, [mask], before, weight=0.5, count=2)
    assert flat.tolist() == [0.0, 0.0, 0.0, 0.0]
    add_deltas(flat, 0, [mask], before)
    assert torch.equal(mask, torch.tensor([0.0, -torch.inf, torch.inf, -0.0]))
    assert torch.signbit(mask[3]), "an unchanged -0.0 keeps its sign"


def test_a_changed_element_beside_infinite_ones_moves_by_the_summed_delta() -> None:
    buf = torch.tensor([1.0, -torch.inf])
    before = [buf.clone()]
    buf[0] = 3.0
    flat = torch.zeros(2)
    write_deltas(flat, 0, [buf], before, weight=0.5, count=2)
    flat *= 2  # two members, the same change
    add_deltas(flat, 0, [buf], before)
    assert buf.tolist() == [3.0, -torch.inf]


class Masked(nn.Module):
    """An MLP whose hidden units are weighted through an additive mask kept as a buffer
    (-inf hides a unit), as attention masks are."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 4)
        mask = torch.zeros(32)
        mask[::4] = -torch.inf
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)) * torch.softmax(self.mask, 0) * 32
        return self.out(h)


def masked_job(steps: int) -> Job:
    return Job(
        name="masked",
        model=Masked,
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.05),
        dataset=TensorDataset(mlp.X, mlp.Y),
        loss=F.cross_entropy,
        batch_size=30,
        num_steps=steps,
        seed=3,
    )


def test_a_mask_buffer_holding_minus_infinity_trains_on_several_nodes_as_in_one_process(tmp_path: Path) -> None:
    j = masked_job(8)
    with MemoryJob(j, ["a", "b"], tmp_path) as mj:
        mj.order(["a", "b"])
        results = mj.join(60)
    assert all(isinstance(r, NodeResult) and r.outcome == "finished" for r in results.values()), results
    got = torch.load(tmp_path / "a.pt", weights_only=True)["model"]
    want = reference_tree(j)["model"]
    assert torch.equal(got["mask"], want["mask"]), got["mask"]
    for k, v in want.items():
        assert torch.allclose(got[k], v, atol=1e-5), k


def test_one_node_keeps_batchnorm_statistics_bit_identical_to_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UB_TEST_BATCHNORM", "1")
    j = mlp.make(6, delay_ms=0)
    with MemoryJob(j, ["a"], tmp_path) as mj:
        mj.order(["a"])
        results = mj.join(60)
    assert isinstance(results["a"], NodeResult) and results["a"].outcome == "finished", results
    got = torch.load(tmp_path / "a.pt", weights_only=True)["model"]
    for k, v in reference_tree(j)["model"].items():
        assert torch.equal(got[k], v), f"{k} differs by {(got[k].double() - v.double()).abs().max().item()}"


def test_each_slice_of_a_step_draws_its_own_noise_keyed_by_its_place_in_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nodes of equal shares seed torch from their slice's place in the batch: different
    noise for different samples, as in one process (before, every node drew the same). The
    seeds are recorded rather than the draws: in-memory nodes are threads sharing torch's
    generator, so what one draws depends on when the other seeds."""
    from unbroken.train import step

    seeded: list[tuple[str, int, int]] = []
    real = step.slice_seed

    def recorded(seed: int, at: int, offset: int) -> int:
        seeded.append((threading.current_thread().name, at, offset))
        return real(seed, at, offset)

    monkeypatch.setattr(step, "slice_seed", recorded)
    j = masked_job(4)
    with MemoryJob(j, ["a", "b"], tmp_path) as mj:
        mj.order(["a", "b"])
        results = mj.join(60)
    assert all(isinstance(r, NodeResult) and r.outcome == "finished" for r in results.values()), results
    for s in range(4):
        offsets = {(who, offset) for who, at, offset in seeded if at == s}
        assert offsets == {("node-a", 0), ("node-b", 15)}, (s, offsets)
    assert real(3, 2, 0) == 3 * 1_000_003 + 2, (
        "one node seeds as a plain loop's torch.manual_seed(seed * 1_000_003 + step)"
    )
    assert len({real(3, 2, o) for o in (0, 1, 15, 29)}) == 4
