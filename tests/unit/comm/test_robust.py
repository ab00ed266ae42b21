"""Robust aggregation: the rules' arithmetic, their bounds, and their determinism."""

from __future__ import annotations

import pytest
import torch

from unbroken.comm.robust import all_finite, combine, trim_count
from unbroken.errors import ConfigError
from unbroken.specs import Rule, parse_rule


def contributions(means: list[torch.Tensor], shares: list[int], batch: int):
    weights = [s / batch for s in shares]
    rows = [m * w for m, w in zip(means, weights, strict=True)]
    norms = [float(torch.linalg.vector_norm(r)) for r in rows]
    return rows, weights, norms


@pytest.mark.parametrize(
    ("spec", "rule"),
    [("mean", Rule("mean")), ("clip", Rule("clip", 2.0)), ("clip:3", Rule("clip", 3.0)),
     ("trimmed", Rule("trimmed", 0.25)), ("trimmed:0.1", Rule("trimmed", 0.1))],
)  # fmt: skip
def test_rules_parse_with_their_defaults(spec: str, rule: Rule) -> None:
    assert parse_rule(spec) == rule
    assert parse_rule(str(rule)) == rule


@pytest.mark.parametrize("spec", ["median", "mean:1", "clip:0.5", "clip:x", "trimmed:0.5", "trimmed:0", ""])
def test_bad_rules_are_refused_with_the_choices(spec: str) -> None:
    with pytest.raises(ConfigError, match="aggregation"):
        parse_rule(spec)


@pytest.mark.parametrize(("n", "fraction", "cut"), [(1, 0.25, 0), (2, 0.25, 0), (3, 0.25, 0), (4, 0.25, 1),
                                                     (5, 0.4, 2), (3, 0.45, 1), (10, 0.1, 1)])  # fmt: skip
def test_trimming_always_keeps_a_value(n: int, fraction: float, cut: int) -> None:
    assert trim_count(n, fraction) == cut
    assert n - 2 * cut >= 1


def test_the_mean_is_the_plain_sum_of_the_weighted_rows() -> None:
    g = torch.Generator().manual_seed(0)
    rows, weights, norms = contributions([torch.randn(50, generator=g) for _ in range(3)], [5, 3, 2], 10)
    assert torch.equal(combine(rows, weights, norms, Rule("mean")), rows[0] + rows[1] + rows[2])


def test_clipping_leaves_honest_nodes_alone() -> None:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(200, generator=g)
    means = [base + 0.3 * torch.randn(200, generator=g) for _ in range(4)]
    rows, weights, norms = contributions(means, [4, 3, 2, 1], 10)
    assert torch.allclose(combine(rows, weights, norms, Rule("clip", 2.0)), sum(rows), atol=1e-6)


def test_clipping_bounds_a_flipped_node() -> None:
    g = torch.Generator().manual_seed(2)
    base = torch.randn(200, generator=g)
    honest = [base + 0.1 * torch.randn(200, generator=g) for _ in range(3)]
    means = [*honest, -10 * honest[0]]
    rows, weights, norms = contributions(means, [3, 3, 3, 3], 12)
    mean = combine(rows, weights, norms, Rule("mean"))
    clipped = combine(rows, weights, norms, Rule("clip", 2.0))
    assert torch.dot(mean, base) < 0  # the mean follows the bad node
    assert torch.dot(clipped, base) > 0  # clipped, the honest majority still wins
    bad_part = clipped - (rows[0] + rows[1] + rows[2])
    typical = sorted(float(torch.linalg.vector_norm(m)) for m in honest)[1]
    assert float(torch.linalg.vector_norm(bad_part)) <= 2.0 * typical * 3 / 12 * (1 + 1e-5)


def test_trimmed_mean_ignores_one_outlier_per_coordinate_and_weights_each_node_once() -> None:
    g = torch.Generator().manual_seed(3)
    honest = [torch.randn(100, generator=g) for _ in range(4)]
    means = [*honest, torch.full((100,), 1e4)]
    rows, weights, norms = contributions(means, [1, 1, 1, 1, 60], 64)  # the outlier holds most of the batch
    out = combine(rows, weights, norms, Rule("trimmed", 0.2))
    stacked = torch.stack(honest)
    expected = (stacked.sum(0) - stacked.min(0).values) / 3  # the top (1e4) and the lowest honest value cut
    assert torch.allclose(out, expected, atol=1e-5)


def test_robust_rules_ignore_members_without_a_share() -> None:
    g = torch.Generator().manual_seed(4)
    means = [torch.randn(30, generator=g) for _ in range(3)]
    rows, weights, norms = contributions(means, [5, 5, 0], 10)
    rows[2] = torch.zeros(30)
    for rule in (Rule("clip", 2.0), Rule("trimmed", 0.25)):
        with_spare = combine(rows, weights, norms, rule)
        without = combine(rows[:2], weights[:2], norms[:2], rule)
        assert torch.equal(with_spare, without)


@pytest.mark.parametrize("rule", [Rule("mean"), Rule("clip", 1.5), Rule("trimmed", 0.25)])
def test_every_member_computes_the_same_bits(rule: Rule) -> None:
    g = torch.Generator().manual_seed(5)
    means = [torch.randn(1000, generator=g) * (i + 1) for i in range(5)]
    rows, weights, norms = contributions(means, [1, 2, 3, 4, 6], 16)
    first = combine([r.clone() for r in rows], weights, norms, rule)
    assert all(torch.equal(first, combine([r.clone() for r in rows], weights, norms, rule)) for _ in range(3))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 16, 17])
def test_the_trimmed_mean_orders_coordinates_exactly_like_a_sort(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    means = [torch.randn(257, generator=g) for _ in range(n)]
    rows, weights, norms = contributions(means, [1] * n, n)
    t = trim_count(n, 0.25)
    exact = [r / w for r, w in zip(rows, weights, strict=True)]  # what each node's row says
    kept = torch.sort(torch.stack(exact), dim=0).values[t : n - t]
    expected = torch.zeros(257)
    for row in kept:
        expected += row
    assert torch.equal(combine(rows, weights, norms, Rule("trimmed", 0.25)), expected / kept.shape[0])


def _row(
    grad: list[float], rank: int, size: int, share: int, declared: float | None = None, overflow: float = 0.0
) -> torch.Tensor:
    """A gathered row: gradient, vote, samples, switch, loss, overflow, then one norm slot per member."""
    g = torch.tensor(grad)
    slots = torch.zeros(size)
    slots[rank] = torch.linalg.vector_norm(g) if declared is None else declared
    return torch.cat([g, torch.tensor([1.0, float(share), 0.0, 0.5, overflow]), slots])


def test_a_rows_lies_are_found_in_the_row_itself() -> None:
    from unbroken.comm.robust import lie

    def check(row: torch.Tensor, share: int = 4, overflow_allowed: bool = True) -> str | None:
        return lie(row, 1, 3, 3, 8, share, overflow_allowed)

    assert check(_row([3.0, 4.0, 0.0], 1, 3, 4)) is None
    assert "not finite" in (check(_row([float("nan"), 4.0, 0.0], 1, 3, 4, declared=5.0)) or "")
    assert "declared a gradient norm of 5" in (check(_row([-3e6, -4e6, 0.0], 1, 3, 4, declared=5.0)) or "")
    forged = _row([3.0, 4.0, 0.0], 1, 3, 4)
    forged[8] = float("inf")  # rank 0's slot
    assert "other members' norm slots" in (check(forged) or "")
    assert "samples" in (check(_row([3.0, 4.0, 0.0], 1, 3, 9)) or "")
    assert check(_row([3.0, 4.0, 0.0], 1, 3, 4, declared=5.0 * (1 + 1e-5))) is None  # rounding is no lie
    assert check(_row([0.0, 0.0, 0.0], 1, 3, 4, overflow=1.0)) is None  # an overflow sends nothing
    assert "overflow but sent a gradient" in (check(_row([3.0, 4.0, 0.0], 1, 3, 4, overflow=1.0)) or "")
    assert "says 7 for its overflow" in (check(_row([0.0, 0.0, 0.0], 1, 3, 4, overflow=7.0)) or "")
    unbelieved = check(_row([0.0, 0.0, 0.0], 1, 3, 4, overflow=1.0), overflow_allowed=False)
    assert "no overflow is believed" in (unbelieved or "")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_finds_one_bad_element_anywhere(dtype: torch.dtype) -> None:
    t = torch.randn(10_001).to(dtype)
    assert all_finite(t) and all_finite(t[:0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 5_000, 10_000):
            u = t.clone()
            u[at] = bad
            assert not all_finite(u), (bad, at)
    both = t.clone()
    both[3], both[7] = float("inf"), float("-inf")  # a sum of NaN, not of an infinity
    assert not all_finite(both)


def test_all_finite_when_only_the_sum_overflows() -> None:
    big = torch.full((64,), torch.finfo(torch.float32).max / 4)
    assert not torch.isfinite(big.sum()) and all_finite(big)
    assert all_finite(torch.full((8,), 60_000.0, dtype=torch.float16))
