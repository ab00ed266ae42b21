"""TrainState: what replicas agree on, its digest, and its serialised form."""

from __future__ import annotations

import json
import random

import torch
from torch import nn

from unbroken.control.messages import TensorSpec
from unbroken.state import layout
from unbroken.state.snapshot import TrainState, deep_copy, digest_prefix, fingerprint


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 2, bias=False).to(torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x)).double())


def make_state(seed: int = 0, lr: float = 0.1) -> TrainState:
    torch.manual_seed(seed)
    model = Net()
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))


def train_step(state: TrainState) -> None:
    g = torch.Generator().manual_seed(state.step)
    x = torch.randn(8, 4, generator=g)
    state.optimizer.zero_grad()
    state.model(x).square().mean().backward()
    state.optimizer.step()
    state.step += 1
    state.cursor += 8


def test_identical_states_have_equal_digests() -> None:
    a, b = make_state(), make_state()
    assert a.digest() == b.digest()
    for _ in range(2):
        train_step(a)
        train_step(b)
    assert a.digest() == b.digest()
    assert len(a.digest()) == 32


def test_a_one_bit_flip_in_a_parameter_changes_the_digest() -> None:
    a = make_state()
    before = a.digest()
    with torch.no_grad():
        w = a.model.fc.weight
        bits = w.view(torch.int32)
        bits[1, 2] ^= 1  # the lowest mantissa bit of one float
    assert a.digest() != before
    with torch.no_grad():
        a.model.fc.weight.view(torch.int32)[1, 2] ^= 1
    assert a.digest() == before


def test_a_buffer_change_changes_the_digest() -> None:
    a = make_state()
    before = a.digest()
    a.model.norm.num_batches_tracked += 1
    assert a.digest() != before


def test_optimizer_state_and_hyper_parameters_change_the_digest() -> None:
    a, b = make_state(), make_state()
    train_step(a)
    train_step(b)
    before = a.digest()
    momentum = a.optimizer.state[a.model.fc.weight]["momentum_buffer"]
    momentum[0, 0] += 1e-3
    assert a.digest() != before
    b.optimizer.param_groups[0]["lr"] = 0.2
    assert b.digest() != before


def test_step_and_cursor_change_the_digest() -> None:
    a = make_state()
    before = a.digest()
    a.step += 1
    after_step = a.digest()
    assert after_step != before
    a.cursor += 1
    assert a.digest() not in (before, after_step)


def test_different_models_have_different_digests() -> None:
    assert make_state(seed=0).digest() != make_state(seed=1).digest()


def test_a_tree_through_its_layout_round_trips_state_and_rng() -> None:
    src = make_state(seed=0)
    for _ in range(3):
        train_step(src)
    torch.manual_seed(1234)
    random.seed(99)
    header, tensors = layout.split(src.tree())
    header = json.loads(json.dumps(header))  # what crosses the wire
    tensors = [t.clone() for t in tensors]
    expected_torch = torch.rand(5)
    expected_py = [random.random() for _ in range(5)]

    dst = make_state(seed=7)
    assert dst.digest() != src.digest()
    torch.manual_seed(0)
    random.seed(0)
    tree = layout.join(header, tensors)
    assert dst.digest_of(tree) == src.digest()
    dst.load_tree(tree)
    assert dst.digest() == src.digest()
    assert (dst.step, dst.cursor) == (3, 24)
    assert torch.equal(torch.rand(5), expected_torch)
    assert [random.random() for _ in range(5)] == expected_py

    train_step(src)
    train_step(dst)  # the restored replica keeps training in lockstep
    assert dst.digest() == src.digest()


def test_a_tree_is_the_state_itself_not_a_copy() -> None:
    a = make_state()
    _, tensors = layout.split(a.tree())
    weight = next(a.model.parameters())
    assert any(t.data_ptr() == weight.data_ptr() for t in tensors), "a donor sends its tensors without copying"


def test_capture_is_a_copy_not_a_view() -> None:
    a = make_state()
    snap = a.capture()
    train_step(a)
    b = make_state(seed=5)
    b.restore(snap)
    assert b.digest() == make_state().digest()


def test_fingerprint_lists_names_shapes_and_dtypes_in_order() -> None:
    fp = fingerprint(Net())
    assert fp[:2] == [
        TensorSpec(name="fc.weight", shape=[3, 4], dtype="float32"),
        TensorSpec(name="fc.bias", shape=[3], dtype="float32"),
    ]
    names = [s.name for s in fp]
    assert names == list(Net().state_dict())
    assert "norm.running_mean" in names and "norm.num_batches_tracked" in names
    by_name = {s.name: s for s in fp}
    assert by_name["norm.num_batches_tracked"].dtype == "int64"
    assert by_name["norm.num_batches_tracked"].shape == []
    assert by_name["head.weight"] == TensorSpec(name="head.weight", shape=[2, 3], dtype="float64")


def test_fingerprint_ignores_values() -> None:
    torch.manual_seed(0)
    a = Net()
    torch.manual_seed(1)
    assert fingerprint(a) == fingerprint(Net())


def test_digest_prefix_fits_a_signed_int64_and_follows_the_digest() -> None:
    assert digest_prefix("f" * 32) == (2**64 - 1) >> 1
    assert digest_prefix("f" * 32) < 2**63
    assert digest_prefix("0" * 32) == 0
    assert digest_prefix("0000000000000002" + "f" * 16) == 1
    d1, d2 = make_state(0).digest(), make_state(1).digest()
    assert digest_prefix(d1) != digest_prefix(d2)


class Residual:
    """A node-local state, as `unbroken.state.snapshot.NodeLocal` describes it."""

    def __init__(self, owner: str, value: float) -> None:
        self.owner = owner
        self.value = torch.full((3,), value)

    def state_dict(self) -> dict[str, object]:
        return {"residual": self.value.clone()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        value = state["residual"]
        assert isinstance(value, torch.Tensor)
        self.value = value


def test_node_local_state_returns_only_to_its_owner_and_stays_out_of_the_digest() -> None:
    a, b = make_state(), make_state()
    a.node_local, b.node_local = Residual("a", 1.0), Residual("b", 2.0)
    assert a.digest() == b.digest()
    snap = a.capture()
    a.node_local.value.fill_(9.0)
    a.restore(snap)  # its own snapshot: the residual comes back
    assert torch.equal(a.node_local.value, torch.full((3,), 1.0))
    b.restore(snap)  # a peer's snapshot: the model is taken, the residual is not
    assert torch.equal(b.node_local.value, torch.full((3,), 2.0))


def test_an_outer_optimizer_is_committed_state_even_when_attached_after_a_restore() -> None:
    a = make_state()
    outer = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.7, momentum=0.9, nesterov=True)
    outer.param_groups[0]["params"][0].grad = torch.ones(2)
    outer.step()
    a.attach_outer(outer)
    snap = a.capture()
    b = make_state()
    b.restore(snap)  # before b has an outer optimizer: kept aside
    fresh = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.7, momentum=0.9, nesterov=True)
    b.attach_outer(fresh)
    assert a.digest() == b.digest()
    fresh.state.clear()
    assert a.digest() != b.digest()


def test_a_kept_snapshot_does_not_move_with_the_training_that_follows_its_restore() -> None:
    a = make_state()
    train_step(a)
    kept = a.capture()
    at = a.digest()
    a.restore(kept)
    train_step(a)  # the momentum buffers change in place
    a.restore(kept)
    assert a.digest() == at, "the optimizer got copies, not the snapshot's own tensors"


def test_capturing_again_reuses_the_tensors_of_the_last_capture() -> None:
    a = make_state()
    train_step(a)
    first = a.capture()
    ptrs = [t.data_ptr() for t in layout.split(first)[1]]
    train_step(a)
    again = a.capture(reuse=first)
    assert [t.data_ptr() for t in layout.split(again)[1]] == ptrs
    b = make_state(seed=3)
    b.restore(again)
    assert b.digest() == a.digest()


def state_with_schedule(seed: int = 0) -> TrainState:
    st = make_state(seed)
    st.scheduler = torch.optim.lr_scheduler.LambdaLR(st.optimizer, lambda s: 1 / (1 + s))
    ema = nn.Linear(4, 3)
    st.extra = {"ema": ema}
    return st


def test_the_scheduler_and_extra_state_are_replicated_state() -> None:
    from unbroken.state.fragments import pack, unpack

    st = state_with_schedule()
    train_step(st)
    st.scheduler.step()
    with torch.no_grad():
        st.extra["ema"].weight.add_(1.0)
    joiner = state_with_schedule(seed=1)
    assert joiner.digest() != st.digest()
    joiner.load_tree(unpack(pack(st.tree())))  # what a transfer hands over, byte for byte
    assert joiner.digest() == st.digest()
    assert joiner.scheduler.last_epoch == 1 and joiner.optimizer.param_groups[0]["lr"] == 0.05
    assert torch.equal(joiner.extra["ema"].weight, st.extra["ema"].weight)
    # Each part counts in the digest: a replica that missed a scheduler step or an EMA update differs.
    before = st.digest()
    st.scheduler.step()
    assert st.digest() != before
    before = st.digest()
    with torch.no_grad():
        st.extra["ema"].bias.add_(1e-3)
    assert st.digest() != before


def test_a_state_without_scheduler_or_extra_has_the_parts_it_had_before() -> None:
    """Checkpoints written before either existed still match their digests."""
    st = make_state()
    assert set(st.tree()) == {"step", "cursor", "model", "optimizer", "rng"}


def test_an_outer_state_saved_under_other_settings_keeps_its_momentum_and_takes_the_new_settings() -> None:
    # A DiLoCo run restarted with a new --outer-lr and --outer-momentum: the checkpoint (or a
    # peer's state) brings the outer momentum buffers, the policy of now the settings.
    old = make_state()
    old.outer = torch.optim.SGD(old.model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for p in old.model.parameters():
        p.grad = torch.ones_like(p)
    old.outer.step()
    snap = old.capture()
    now = {"lr": 0.3, "momentum": 0.0, "nesterov": False}
    for attached_first in (True, False):
        new = make_state()
        new.outer_settings = dict(now)
        outer = torch.optim.SGD(new.model.parameters(), **now)  # type: ignore[arg-type]
        if attached_first:
            new.attach_outer(outer)
            new.restore(snap)  # a peer's state, or a rollback
        else:
            new.restore(snap)  # a checkpoint, before the outer loop exists
            new.attach_outer(outer)
        (group,) = outer.param_groups
        assert {k: group[k] for k in now} == now, attached_first
        buffers = [outer.state[p]["momentum_buffer"] for p in new.model.parameters()]
        assert all(torch.equal(b, torch.ones_like(b)) for b in buffers), attached_first


def test_a_deep_copy_clones_every_tensor_once_and_shares_nothing() -> None:
    t = torch.arange(6.0)
    tree = {"state": {0: {"momentum_buffer": t, "step": torch.tensor(3.0)}}, "groups": [{"lr": 0.1, "params": [0]}]}
    tree["again"] = t  # the same tensor twice stays one tensor in the copy
    out = deep_copy(tree)
    got = out["state"][0]["momentum_buffer"]
    assert torch.equal(got, t) and got.data_ptr() != t.data_ptr() and out["again"] is got
    assert out["groups"] == tree["groups"] and out["groups"] is not tree["groups"]
    t.zero_()
    assert torch.equal(got, torch.arange(6.0))


def test_the_lineage_crosses_the_wire_and_back_from_a_capture_and_is_not_in_the_digest() -> None:
    src = make_state(seed=0)
    train_step(src)
    before = src.digest()
    src.lineage = 2  # the job went back to a checkpoint twice
    assert src.digest() == before, "the digest says what the state is, not which history"
    header, tensors = layout.split(src.tree())
    dst = make_state(seed=0)
    dst.load_tree(layout.join(json.loads(json.dumps(header)), [t.clone() for t in tensors]))
    assert dst.lineage == 2
    dst.restore(make_state(seed=0).capture())  # a state from before any rollback
    assert dst.lineage == 0
