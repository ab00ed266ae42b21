"""The gradient's buckets: their layout, and their sums posted in order while backward runs."""

from __future__ import annotations

import itertools
import math
import threading

import pytest
import torch
from torch import nn

from unbroken.train.buckets import Bucket, Buckets, layout


@pytest.mark.parametrize(
    ("numels", "cap"),
    [([10, 20, 30, 40], 80), ([1] * 50, 12), ([1000], 4), ([5, 5], 1 << 20), ([3, 100, 3], 16)],
)
def test_buckets_cover_the_gradient_from_its_end_in_whole_parameters(numels: list[int], cap: int) -> None:
    buckets = layout(numels, cap)
    ends = [sum(numels[:i]) for i in range(len(numels) + 1)]
    assert buckets[0].hi == ends[-1] and buckets[-1].lo == 0
    for a, b in itertools.pairwise(buckets):
        assert a.lo == b.hi  # contiguous, from the end
    for k, bucket in enumerate(buckets):
        assert list(bucket.params) == list(range(bucket.params[0], bucket.params[-1] - 1, -1))
        assert (bucket.lo, bucket.hi) == (ends[bucket.params[-1]], ends[bucket.params[0] + 1])
        size = 4 * (bucket.hi - bucket.lo)
        if k < len(buckets) - 1:
            assert size >= cap  # closed once full...
        assert size - 4 * numels[bucket.params[-1]] < cap  # ...and not later


def test_buckets_fill_up_to_the_cap_from_the_last_parameter() -> None:
    assert layout([100] * 10, cap_bytes=1200) == [
        Bucket(700, 1000, (9, 8, 7)),
        Bucket(400, 700, (6, 5, 4)),
        Bucket(100, 400, (3, 2, 1)),
        Bucket(0, 100, (0,)),
    ]


class Net(nn.Module):
    def __init__(self, skip_middle: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.skip_middle = skip_middle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if not self.skip_middle:
            h = torch.tanh(self.b(h))
        return self.c(h)


def _buckets(model: nn.Module, cap_floats: int) -> tuple[Buckets, list[tuple[int, int]], list[torch.Tensor]]:
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params) + 7)  # a tail follows the gradient
    sent: list[tuple[int, int]] = []
    prepared: list[torch.Tensor] = []

    def post(piece: torch.Tensor) -> tuple[int, int]:
        lo = (piece.data_ptr() - flat.data_ptr()) // 4
        sent.append((lo, lo + piece.numel()))
        return sent[-1]

    def prepare(piece: torch.Tensor) -> None:
        prepared.append(piece.clone())
        piece.mul_(2.0)  # what goes out is what prepare made of it

    numels = [p.numel() for p in params]
    return Buckets(params, flat, layout(numels, 4 * cap_floats), post, prepare), sent, prepared


def test_buckets_go_out_during_the_last_backward_in_order() -> None:
    torch.manual_seed(0)
    model = Net()
    buckets, sent, _ = _buckets(model, cap_floats=20)
    x = torch.randn(6, 8)
    model(x[:3]).square().sum().backward()  # an earlier micro-batch: nothing goes out
    assert sent == []
    with buckets.during_backward():
        model(x[3:]).square().sum().backward()
        during = list(sent)
    assert len(buckets.buckets) > 2 and during == [(b.lo, b.hi) for b in buckets.buckets], "all, in bucket order"
    assert buckets.complete() == during and buckets.end == buckets.buckets[0].hi == buckets.flat.numel() - 7
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
    assert torch.equal(buckets.flat[: grads.numel()], 2 * grads), "the whole accumulated gradient, prepared"
    assert torch.equal(buckets.flat[grads.numel() :], torch.zeros(7)), "the tail is the caller's"
    model(x).sum().backward()  # hooks removed: nothing more goes out
    assert len(sent) == len(during)


def test_an_unused_parameter_holds_its_bucket_back_and_complete_sends_it_as_zeros_in_order() -> None:
    torch.manual_seed(0)
    model = Net(skip_middle=True)
    buckets, sent, prepared = _buckets(model, cap_floats=20)
    b_weight = 2  # model.b.weight's index in the parameter list
    held = next(k for k, b in enumerate(buckets.buckets) if b_weight in b.params)
    with buckets.during_backward():
        model(torch.randn(4, 8)).square().sum().backward()
    assert len(sent) == held, "the buckets before the unused parameter's went out, and no later one"
    buckets.complete()
    assert sent == [(b.lo, b.hi) for b in buckets.buckets]
    lo = sum(p.numel() for p in list(model.parameters())[:b_weight])
    assert torch.equal(buckets.flat[lo : lo + model.b.weight.numel()], torch.zeros(model.b.weight.numel()))
    assert len(prepared) == len(buckets.buckets), "every bucket prepared once"


def test_a_member_that_computed_nothing_sends_the_same_buckets() -> None:
    model = Net()
    buckets, sent, _ = _buckets(model, cap_floats=20)
    buckets.complete()
    assert sent == [(b.lo, b.hi) for b in buckets.buckets]
    assert torch.equal(buckets.flat, torch.zeros_like(buckets.flat))
    buckets.reset()
    assert buckets.posted == 0


def test_a_single_bucket_is_left_to_go_out_with_the_tail() -> None:
    model = Net()
    buckets, sent, prepared = _buckets(model, cap_floats=10_000)
    with buckets.during_backward():
        model(torch.randn(4, 8)).sum().backward()
        assert prepared == [], "no hooks: nothing to post before the tail"
    assert buckets.complete() == [] and sent == [] and len(prepared) == 1 and buckets.end == 0
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
    assert torch.equal(buckets.flat[: grads.numel()], 2 * grads)


@pytest.mark.parametrize("fault", ["spike@grad:3", "hide-spike@grad:3"])
def test_a_fault_of_one_step_spoils_every_bucket_of_it_and_the_norm_counts_what_was_true(fault: str) -> None:
    from types import SimpleNamespace

    from unbroken.comm.group import EpochScope
    from unbroken.comm.reduce import Reducer
    from unbroken.sched.zones import Zones
    from unbroken.testing.faults import FaultPlan, parse_faults
    from unbroken.train.step import StepProtocol

    torch.manual_seed(0)
    model = Net()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    sent: list[torch.Tensor] = []
    pg = SimpleNamespace(allreduce=lambda tensors: sent.append(tensors[0].clone()))
    node = SimpleNamespace(
        numel=numel, compressed_numel=numel, scale=None, zone=None,
        faults=FaultPlan(parse_faults(fault), lambda _k, _f: None),
        replica=SimpleNamespace(params=params, device=torch.device("cpu")),
        scope=lambda **_kw: EpochScope(threading.Event(), lambda: None, 10.0), client=SimpleNamespace(lapses=0),
    )  # fmt: skip
    group = SimpleNamespace(shares=[4], rank=0, size=1)
    reducer = Reducer(0, Zones(()), pg, bucket_bytes=4 * 20)
    protocol = StepProtocol(node, group, reducer)  # type: ignore[arg-type]
    assert protocol.buckets is not None and len(protocol.buckets.buckets) > 2
    protocol._start_gradient(3)
    with protocol.backward():
        model(torch.randn(4, 8)).square().sum().backward()
    protocol.buckets.complete()
    grads = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
    factor = 1e6 if fault.startswith("spike") else -1e6
    assert torch.allclose(protocol.flat[:numel], factor * grads), "every bucket, not only the first out"
    true_norm = float(torch.linalg.vector_norm(grads)) * (1e6 if fault.startswith("spike") else 1.0)
    assert math.isclose(protocol._squares**0.5, true_norm, rel_tol=1e-4), "a lie hides behind the true norm"
    protocol._start_gradient(4)
    assert protocol._poison is None and protocol._lie == ("hide-spike" if fault.startswith("hide") else None)
