"""A DataLoader's order, read without loading a sample, is the order iterating it gives."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

from unbroken.errors import ConfigError
from unbroken.job import Job
from unbroken.train.data import DataPlan, LoaderOrder


def _data(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _loader(n: int, b: int, drop_last: bool, seed: int = 0) -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(_data(n), batch_size=b, shuffle=True, drop_last=drop_last, generator=g)


@pytest.mark.parametrize("drop_last", [True, False])
def test_passes_are_what_iterating_the_loader_gives(drop_last: bool) -> None:
    plain = _loader(50, 8, drop_last)
    iterated = [[int(i) for (x,) in plain for i in x] for _ in range(4)]
    order = LoaderOrder(_loader(50, 8, drop_last))
    assert [order(k) for k in range(4)] == iterated
    assert len(set(map(tuple, iterated))) == 4  # each pass its own shuffle
    assert all(len(p) == (48 if drop_last else 50) for p in iterated)


def test_a_pass_asked_again_or_out_of_sequence_is_the_same() -> None:
    order = LoaderOrder(_loader(30, 4, True))
    third = order(2)
    assert order(0) == LoaderOrder(_loader(30, 4, True))(0)
    assert order(2) == third


def test_the_plan_reads_the_loader_order_across_passes() -> None:
    order = LoaderOrder(_loader(20, 5, True))
    plan = DataPlan(len(order(0)), 5, 0, order)
    stream = [i for s in range(8) for i in plan.indices(s, 0, 5)]
    assert stream == order(0) + order(1)


def test_an_unseeded_shuffle_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"generator=torch.Generator\(\).manual_seed\(0\)"):
        LoaderOrder(DataLoader(_data(10), batch_size=2, shuffle=True))
    LoaderOrder(DataLoader(_data(10), batch_size=2, sampler=SequentialSampler(range(10))))


def test_the_order_is_part_of_the_job_identity() -> None:
    def job(seed: int) -> Job:
        order = LoaderOrder(_loader(40, 8, True, seed))
        return Job(
            name="j", model=lambda: torch.nn.Linear(1, 1), optimizer=lambda m: torch.optim.SGD(m.parameters()),
            dataset=_data(40), step=lambda m, b: m(b[0].float()).sum(), batch_size=8, num_steps=3, order=order,
        )  # fmt: skip

    assert job(0).identity() == job(0).identity()
    assert job(0).identity() != job(1).identity()
    assert job(0).num_samples == 40


def test_a_pass_of_another_length_is_refused() -> None:
    plan = DataPlan(10, 5, 0, lambda k: list(range(10 if k == 0 else 9)))
    plan.indices(1, 0, 5)
    with pytest.raises(ConfigError, match="every pass must read the same number"):
        plan.indices(2, 0, 5)


def test_a_sampler_on_the_global_generator_reads_the_same_order_on_every_node() -> None:
    def node(noise: int) -> list[list[int]]:
        torch.manual_seed(noise)  # whatever each node's own code drew before
        loader = DataLoader(_data(30), batch_size=5, sampler=torch.utils.data.SubsetRandomSampler(range(30)))
        order = LoaderOrder(loader, seed=7)
        return [order(k) for k in (0, 1, 2, 1)]

    a, b = node(1), node(2)
    assert a == b and a[1] == a[3] and a[0] != a[1]
    assert sorted(a[2]) == list(range(30))


def test_persistent_workers_draw_the_base_seed_once_as_the_loader_does() -> None:
    def loader() -> DataLoader[tuple[torch.Tensor, ...]]:
        g = torch.Generator().manual_seed(3)
        return DataLoader(_data(24), batch_size=6, shuffle=True, generator=g, num_workers=1, persistent_workers=True)

    plain = loader()
    iterated = [[int(i) for (x,) in plain for i in x] for _ in range(3)]
    order = LoaderOrder(loader())
    assert [order(k) for k in range(3)] == iterated


def test_a_pass_asked_again_after_later_ones_is_the_same_with_a_nested_sampler() -> None:
    """A batch sampler wrapping a shuffling sampler with its own generator: a rollback asks
    for an earlier pass again, after later ones were drawn."""

    def loader() -> DataLoader[tuple[torch.Tensor, ...]]:
        inner = torch.utils.data.RandomSampler(range(20), generator=torch.Generator().manual_seed(4))
        return DataLoader(_data(20), batch_sampler=torch.utils.data.BatchSampler(inner, 5, drop_last=True))

    plain = loader()
    iterated = [[int(i) for (x,) in plain for i in x] for _ in range(8)]
    order = LoaderOrder(loader())
    assert [order(k) for k in range(8)] == iterated
    assert order(1) == iterated[1] and order(2) == iterated[2]  # out of sequence, older than the kept passes


def test_a_list_as_the_sampler_reads_its_order() -> None:
    """PyTorch takes any iterable of indices as a sampler (``sampler=[...]``): it has no
    attributes to look for generators in (it used to crash: ``vars()`` of a list)."""
    data = TensorDataset(torch.arange(8.0))
    indices = [5, 3, 7, 1, 0, 2, 6, 4]
    loader = DataLoader(data, batch_size=2, sampler=indices)
    order = LoaderOrder(loader)
    assert order(0) == indices and order(1) == indices
