"""Devices: choosing one, describing it, the compute replica, calibration and memory caps."""

from __future__ import annotations

import itertools
from collections import namedtuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from unbroken.control.messages import Capabilities
from unbroken.errors import ConfigError
from unbroken.train.device import (
    MAX_MICROBATCH,
    STATE_BYTES_PER_PARAM_BYTE,
    Calibration,
    ComputeReplica,
    SavedBytes,
    calibrate,
    describe,
    microbatch_cap,
    resolve_device,
)

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the behaviour without CUDA")


# ---------------------------------------------------------------- resolve_device


@needs_no_cuda
def test_auto_resolves_to_the_cpu_on_a_machine_without_accelerators() -> None:
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        pytest.skip("MPS is available here")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(" AUTO ") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cpu", "CPU", " cpu "])
def test_cpu_is_accepted(spec: str) -> None:
    assert resolve_device(spec) == torch.device("cpu")


@needs_no_cuda
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_without_cuda_says_so_and_suggests_the_cpu(spec: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_device(spec)
    msg = str(info.value)
    assert "CUDA" in msg
    assert "no CUDA device" in msg
    assert "--device cpu" in msg
    assert spec in msg


@pytest.mark.parametrize("spec", ["tpu", "bogus", "cuda:x", ""])
def test_an_unknown_device_names_the_accepted_values(spec: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_device(spec)
    msg = str(info.value)
    assert "is not a device" in msg
    for accepted in ("auto", "cpu", "cuda", "cuda:N", "mps"):
        assert accepted in msg


def test_a_device_type_torch_knows_but_unbroken_does_not_support_is_refused() -> None:
    with pytest.raises(ConfigError, match="not supported"):
        resolve_device("meta")


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        resolve_device("bogus")


# ---------------------------------------------------------------- describe


def test_describe_the_cpu_reports_host_memory_and_this_process() -> None:
    info = describe(torch.device("cpu"))
    assert info.kind == "cpu"
    assert info.memory_total > 0
    assert info.memory_used > 0  # this process's resident memory
    assert info.memory_used < info.memory_total
    assert 0 < info.memory_available <= info.memory_total
    assert "cores" in info.name and "threads" in info.name


# ---------------------------------------------------------------- ComputeReplica


def small_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3))


def grads_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> list[torch.Tensor]:
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_a_separate_replica_is_a_distinct_copy_with_equal_values() -> None:
    master = small_model()
    replica = ComputeReplica(master, torch.device("cpu"), separate=True)
    assert replica.separate
    assert replica.model is not master
    pairs = list(zip(replica.model.parameters(), master.parameters(), strict=True))
    for mine, theirs in pairs:
        assert mine.data_ptr() != theirs.data_ptr()
        assert torch.equal(mine, theirs)
    assert replica.params == [p for p in replica.model.parameters()]


def test_the_default_on_the_cpu_is_no_copy() -> None:
    master = small_model()
    replica = ComputeReplica(master, torch.device("cpu"))
    assert replica.separate is False
    assert replica.model is master


def test_without_a_copy_the_replica_is_the_master_and_to_device_is_the_identity() -> None:
    master = small_model()
    replica = ComputeReplica(master, torch.device("cpu"), separate=False)
    assert replica.model is master
    assert replica.params[0] is next(master.parameters())
    batch = (torch.ones(2), {"a": torch.zeros(1)})
    assert replica.to_device(batch) is batch
    with torch.no_grad():
        next(master.parameters()).add_(1.0)
    replica.pull()  # a no-op: nothing to refresh
    assert replica.model is master


def test_pull_copies_parameters_and_buffers_changed_in_place_on_the_master() -> None:
    master = small_model()
    replica = ComputeReplica(master, torch.device("cpu"), separate=True)
    with torch.no_grad():
        for p in master.parameters():
            p.mul_(-2.0).add_(0.5)
        bn = master[1]
        assert isinstance(bn, nn.BatchNorm1d)
        bn.running_mean.add_(3.0)
        bn.running_var.mul_(7.0)
        bn.num_batches_tracked.add_(5)
    before = [p.clone() for p in replica.model.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(before, master.parameters(), strict=True))
    replica.pull()
    for mine, theirs in itertools.chain(
        zip(replica.model.parameters(), master.parameters(), strict=True),
        zip(replica.model.buffers(), master.buffers(), strict=True),
    ):
        assert torch.equal(mine, theirs)
        assert mine.data_ptr() != theirs.data_ptr()  # copied, not aliased


def test_gradients_on_the_replica_are_bit_identical_to_the_masters() -> None:
    master = small_model(seed=3)
    replica = ComputeReplica(master, torch.device("cpu"), separate=True)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(16, 5, generator=gen)
    y = torch.randint(0, 3, (16,), generator=gen)
    on_replica = grads_of(replica.model, replica.to_device(x), replica.to_device(y), seed=42)
    on_master = grads_of(master, x, y, seed=42)
    assert len(on_replica) == len(on_master) == len(list(master.parameters()))
    for a, b in zip(on_replica, on_master, strict=True):
        assert torch.equal(a, b)
    # Batch statistics moved identically too.
    for a, b in zip(replica.model.buffers(), master.buffers(), strict=True):
        assert torch.equal(a, b)
    # The master's gradients are its own: the replica's backward did not write them.
    assert all(p.grad is not None for p in master.parameters())
    assert all(p.grad is not q.grad for p, q in zip(master.parameters(), replica.model.parameters(), strict=True))


def test_gradients_stay_identical_after_the_master_steps_and_the_replica_pulls() -> None:
    master = small_model(seed=5)
    replica = ComputeReplica(master, torch.device("cpu"), separate=True)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(8, 5, generator=gen)
        y = torch.randint(0, 3, (8,), generator=gen)
        replica.pull()
        on_replica = grads_of(replica.model, x, y, seed=step)
        on_master = grads_of(master, x, y, seed=step)
        for a, b in zip(on_replica, on_master, strict=True):
            assert torch.equal(a, b)
        with torch.no_grad():  # the master steps (plain SGD)
            for p in master.parameters():
                p.sub_(0.1 * p.grad)


class WithFlags(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("mask", torch.ones(4, dtype=torch.bool))
        self.register_buffer("counts", torch.zeros(4, dtype=torch.int32))
        self.register_buffer("scale", torch.ones(2, dtype=torch.float16))


def test_buffers_yields_the_float_and_int64_buffers_only() -> None:
    replica = ComputeReplica(WithFlags(), torch.device("cpu"), separate=True)
    got = list(replica.buffers())
    bn = replica.model.bn
    expected = [replica.model.scale, bn.running_mean, bn.running_var, bn.num_batches_tracked]  # own first
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a is b
    assert {b.dtype for b in got} == {torch.float32, torch.int64, torch.float16}
    assert all(b.dtype not in (torch.bool, torch.int32) for b in got)


def test_buffers_of_an_unseparated_replica_are_the_masters() -> None:
    master = small_model()
    replica = ComputeReplica(master, torch.device("cpu"), separate=False)
    assert [id(b) for b in replica.buffers()] == [id(b) for b in master.buffers()]


def test_to_device_keeps_the_structure_of_nested_tuples_lists_and_dicts() -> None:
    replica = ComputeReplica(small_model(), torch.device("cpu"), separate=True)
    t1, t2, t3 = torch.arange(3), torch.ones(2, 2), torch.zeros(1)
    batch = ((t1, [t2, {"x": t3, "name": "s", "n": 4}]), {"y": (t1,)})
    out = replica.to_device(batch)
    assert type(out) is tuple and type(out[0]) is tuple and type(out[0][1]) is list
    assert type(out[0][1][1]) is dict and type(out[1]) is dict and type(out[1]["y"]) is tuple
    assert torch.equal(out[0][0], t1)
    assert torch.equal(out[0][1][0], t2)
    assert torch.equal(out[0][1][1]["x"], t3)
    assert out[0][1][1]["name"] == "s" and out[0][1][1]["n"] == 4
    assert torch.equal(out[1]["y"][0], t1)
    assert all(t.device.type == "cpu" for t in (out[0][0], out[0][1][0], out[1]["y"][0]))


Pair = namedtuple("Pair", ["inputs", "targets"])


def test_to_device_keeps_a_namedtuple_batch() -> None:
    replica = ComputeReplica(small_model(), torch.device("cpu"), separate=True)
    batch = Pair(torch.ones(2), torch.zeros(2))
    out = replica.to_device(batch)
    assert type(out) is Pair
    assert torch.equal(out.inputs, batch.inputs) and torch.equal(out.targets, batch.targets)


def test_synchronize_on_the_cpu_is_a_no_op() -> None:
    ComputeReplica(small_model(), torch.device("cpu"), separate=True).synchronize()


# ---------------------------------------------------------------- calibrate


def fake_time(n: int) -> float:
    return 0.01 + 0.002 * n


def fake_bytes(n: int) -> int:
    return 1000 + 300 * n


@pytest.mark.parametrize("k", [4, 10, 33])
def test_calibrate_recovers_a_linear_cost_model(k: int) -> None:
    cal = calibrate(fake_time, fake_bytes, k)
    assert cal.per_sample_s == pytest.approx(0.002, rel=1e-9)
    assert cal.overhead_s == pytest.approx(0.01, rel=1e-9)
    assert cal.activation_bytes_per_sample == 300
    assert cal.activation_bytes_fixed == 1000


def test_calibrate_measures_two_samples_and_at_least_four() -> None:
    asked: list[int] = []

    def run(n: int) -> float:
        asked.append(n)
        return fake_time(n)

    cal = calibrate(run, fake_bytes, k=1, repeats=3)
    assert sorted(set(asked)) == [2, 4]
    assert asked.count(2) == 3 and asked.count(4) == 3
    assert cal.per_sample_s == pytest.approx(0.002)


def test_calibrate_takes_the_best_of_the_repeats() -> None:
    noise = {2: iter([0.5, 0.0, 0.2]), 8: iter([0.3, 0.1, 0.0])}

    def run(n: int) -> float:
        return fake_time(n) + next(noise[n])

    cal = calibrate(run, fake_bytes, k=8, repeats=3)
    assert cal.per_sample_s == pytest.approx(0.002)
    assert cal.overhead_s == pytest.approx(0.01)


def test_calibrate_never_reports_a_zero_or_negative_cost() -> None:
    # Faster with more samples (noise): the per-sample cost is floored, not negative.
    cal = calibrate(lambda n: 0.1 if n == 2 else 0.05, lambda n: 100, k=10)
    assert cal.per_sample_s > 0
    assert cal.overhead_s >= 0
    assert cal.activation_bytes_per_sample >= 1
    assert cal.activation_bytes_fixed >= 0


@given(
    overhead=st.floats(0.0, 1.0),
    per_sample=st.floats(1e-6, 1.0),
    fixed=st.integers(0, 10**9),
    per=st.integers(1, 10**7),
    k=st.integers(4, 256),
)
def test_calibrate_is_exact_for_any_linear_model(
    overhead: float, per_sample: float, fixed: int, per: int, k: int
) -> None:
    cal = calibrate(lambda n: overhead + per_sample * n, lambda n: fixed + per * n, k)
    assert cal.per_sample_s == pytest.approx(max(per_sample, (overhead / k + per_sample) * 0.05), rel=1e-6)
    assert cal.overhead_s == pytest.approx(max(overhead + 2 * per_sample - 2 * cal.per_sample_s, 0.0), abs=1e-9)
    assert cal.activation_bytes_per_sample == per
    assert cal.activation_bytes_fixed == fixed


# ---------------------------------------------------------------- microbatch_cap

CAL = Calibration(per_sample_s=0.001, overhead_s=0.0, activation_bytes_per_sample=100, activation_bytes_fixed=50)
MODEL_BYTES = 1000
STATE = MODEL_BYTES * STATE_BYTES_PER_PARAM_BYTE


def test_no_budget_and_no_user_cap_mean_no_limit() -> None:
    assert microbatch_cap(CAL, MODEL_BYTES, budget=0, user_cap=0) == 0


def test_a_user_cap_alone_is_the_cap() -> None:
    assert microbatch_cap(CAL, MODEL_BYTES, budget=0, user_cap=7) == 7


@pytest.mark.parametrize("budget", [1, STATE, STATE + 50, STATE + 50 + 99])
def test_a_budget_too_small_for_one_sample_is_minus_one(budget: int) -> None:
    assert microbatch_cap(CAL, MODEL_BYTES, budget=budget, user_cap=0) == -1
    assert microbatch_cap(CAL, MODEL_BYTES, budget=budget, user_cap=4) == -1


@pytest.mark.parametrize("n", [1, 2, 17, 1000])
def test_a_budget_for_exactly_n_samples_caps_at_n(n: int) -> None:
    budget = STATE + CAL.activation_bytes_fixed + n * CAL.activation_bytes_per_sample
    assert microbatch_cap(CAL, MODEL_BYTES, budget=budget, user_cap=0) == n
    assert microbatch_cap(CAL, MODEL_BYTES, budget=budget - 1, user_cap=0) == (n - 1 if n > 1 else -1)
    assert microbatch_cap(CAL, MODEL_BYTES, budget=budget + 99, user_cap=0) == n


def test_the_smaller_of_the_budget_and_the_user_cap_wins() -> None:
    budget = STATE + 50 + 10 * 100
    assert microbatch_cap(CAL, MODEL_BYTES, budget=budget, user_cap=4) == 4
    assert microbatch_cap(CAL, MODEL_BYTES, budget=budget, user_cap=25) == 10
    assert microbatch_cap(CAL, MODEL_BYTES, budget=budget, user_cap=10) == 10


@given(
    budget=st.integers(1, 10**7),
    model_bytes=st.integers(0, 10**5),
    per=st.integers(1, 10**4),
    fixed=st.integers(0, 10**4),
    user_cap=st.integers(0, 100),
)
def test_the_cap_is_the_largest_micro_batch_that_fits(
    budget: int, model_bytes: int, per: int, fixed: int, user_cap: int
) -> None:
    cal = Calibration(0.001, 0.0, per, fixed)

    def need(n: int) -> int:
        return model_bytes * STATE_BYTES_PER_PARAM_BYTE + fixed + n * per

    cap = microbatch_cap(cal, model_bytes, budget, user_cap)
    if need(1) > budget:
        assert cap == -1
        return
    assert cap >= 1
    assert need(cap) <= budget
    if user_cap:
        assert cap <= user_cap
    if not user_cap or cap < user_cap:
        assert need(cap + 1) > budget


# ---------------------------------------------------------------- SavedBytes


def test_saved_bytes_counts_what_autograd_keeps_and_more_for_a_larger_batch() -> None:
    model = small_model()
    model.train()

    def saved(n: int) -> int:
        with SavedBytes() as counter:
            model(torch.randn(n, 5)).sum()
        return counter.total

    two, eight = saved(2), saved(8)
    assert two > 0
    assert eight > two
    # The first linear layer alone saves its (n, 5) float32 input.
    assert two >= 2 * 5 * 4


def test_saved_bytes_counts_nothing_without_grad_and_stops_on_exit() -> None:
    model = nn.Linear(4, 4)
    with torch.no_grad(), SavedBytes() as counter:
        model(torch.randn(3, 4))
    assert counter.total == 0
    with SavedBytes() as counter:
        model(torch.randn(3, 4))
    inside = counter.total
    assert inside >= 3 * 4 * 4
    model(torch.randn(3, 4))  # outside the block: not counted
    assert counter.total == inside


def test_saved_bytes_do_not_change_the_gradients() -> None:
    a, b = small_model(seed=2), small_model(seed=2)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    with SavedBytes():
        ga = grads_of(a, x, y, seed=0)
    gb = grads_of(b, x, y, seed=0)
    for p, q in zip(ga, gb, strict=True):
        assert torch.equal(p, q)


def test_a_node_that_measured_almost_no_activation_memory_stays_within_what_a_hello_carries() -> None:
    """12 GB of memory at one byte a sample (a measurement that failed on memory) once made
    a cap of 11.8 billion, which no hello may carry: the node could not join."""
    tiny = Calibration(per_sample_s=0.0, overhead_s=0.0, activation_bytes_per_sample=1, activation_bytes_fixed=0)
    cap = microbatch_cap(tiny, MODEL_BYTES, budget=12 << 30, user_cap=0)
    assert cap == MAX_MICROBATCH
    Capabilities(max_microbatch=cap)
