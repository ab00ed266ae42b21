"""find_stragglers: trainers slow against both their plan and their peers, by medians."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.sched.stragglers import MAD_Z, MATTERS, MIN_SAMPLES, RATIO, find_stragglers


def steady(t: float, n: int = 5) -> list[float]:
    return [t] * n


def test_no_verdict_without_times() -> None:
    assert find_stragglers({}, {}) == {}


def test_no_verdict_with_fewer_than_min_samples() -> None:
    few = MIN_SAMPLES - 1
    times = {"a": steady(0.1, few), "b": steady(0.1, few), "c": steady(0.4, few)}
    assert find_stragglers(times, {}) == {}
    assert find_stragglers(times, {"a": 0.1, "b": 0.1, "c": 0.1}) == {}


def test_slow_node_with_too_few_samples_is_not_judged_but_others_are_unaffected() -> None:
    times = {"a": steady(0.1), "b": steady(0.1), "c": steady(0.4, MIN_SAMPLES - 1)}
    assert find_stragglers(times, {}) == {}


def test_exactly_min_samples_is_enough() -> None:
    times = {"a": steady(0.1, MIN_SAMPLES), "b": steady(0.1, MIN_SAMPLES), "c": steady(0.4, MIN_SAMPLES)}
    assert set(find_stragglers(times, {})) == {"c"}


def test_trainer_4x_slower_than_peers_is_flagged_with_its_figures() -> None:
    times = {"a": steady(0.1), "b": steady(0.1), "c": steady(0.4)}
    expected = {"a": 0.1, "b": 0.1, "c": 0.1}
    out = find_stragglers(times, expected)
    assert out == {"c": "compute 400.0 ms/step over its last 3 steps vs 100.0 ms peers' median (4.0x)"}


def test_trainer_4x_slower_is_flagged_without_a_prediction() -> None:
    times = {"a": steady(0.1), "b": steady(0.1), "c": steady(0.4)}
    assert set(find_stragglers(times, {})) == {"c"}


def test_only_the_most_recent_steps_are_judged() -> None:
    # Slow long ago, fast now: not a straggler; fast long ago, slow for two steps: one.
    times = {"a": steady(0.1, 8), "b": steady(0.1, 8), "c": [0.4] * 6 + [0.1, 0.1]}
    assert find_stragglers(times, {}) == {}
    times["c"] = [0.1] * 6 + [0.4, 0.41]
    out = find_stragglers(times, {})
    assert "over its last 3 steps" in out["c"] and "400.0 ms/step" in out["c"]


def test_two_trainers_one_slow() -> None:
    times = {"a": steady(0.1), "b": steady(0.4)}
    assert set(find_stragglers(times, {"a": 0.1, "b": 0.1})) == {"b"}
    assert set(find_stragglers(times, {})) == {"b"}


def test_one_slow_outlier_step_is_not_a_straggler() -> None:
    times = {"a": steady(0.1), "b": steady(0.1), "c": [0.1, 0.1, 5.0, 0.1, 0.1]}
    assert find_stragglers(times, {"a": 0.1, "b": 0.1, "c": 0.1}) == {}
    assert find_stragglers(times, {}) == {}


def test_slow_because_its_planned_share_is_larger_is_not_flagged() -> None:
    # c was planned 4x the samples of a and b: its 400 ms is what the plan predicted.
    times = {"a": steady(0.1), "b": steady(0.1), "c": steady(0.4)}
    assert find_stragglers(times, {"a": 0.1, "b": 0.1, "c": 0.4}) == {}
    # Up to just under RATIO times its prediction is still the plan's doing.
    assert find_stragglers(times, {"a": 0.1, "b": 0.1, "c": 0.4 / RATIO + 1e-6}) == {}


def test_slow_against_plan_but_not_against_peers_is_not_flagged() -> None:
    # Everyone slowed 4x (shared cause): nobody stands out among its peers.
    times = {"a": steady(0.4), "b": steady(0.4), "c": steady(0.4)}
    assert find_stragglers(times, {"a": 0.1, "b": 0.1, "c": 0.1}) == {}


def test_below_ratio_of_peers_is_not_flagged() -> None:
    times = {"a": steady(0.1), "b": steady(0.1), "c": steady(0.14)}
    assert find_stragglers(times, {}) == {}


def test_peers_spread_protects_a_moderately_slow_node() -> None:
    # Peers' medians 0.1..0.4: baseline 0.25, scaled MAD 0.148; 0.5 is 2x the baseline but
    # within MAD_Z deviations, 0.8 is beyond.
    peers = {"a": steady(0.1), "b": steady(0.2), "c": steady(0.3), "d": steady(0.4)}
    spread = 0.1 * 1.4826
    assert 0.5 - 0.25 < MAD_Z * spread < 0.8 - 0.25
    assert find_stragglers({**peers, "e": steady(0.5)}, {}) == {}
    out = find_stragglers({**peers, "e": steady(0.8)}, {})
    assert set(out) == {"e"}
    assert "vs 250.0 ms peers' median (3.2x)" in out["e"]


def test_several_stragglers_are_all_flagged() -> None:
    times = {"a": steady(0.1), "b": steady(0.1), "c": steady(0.1), "d": steady(0.5), "e": steady(0.6)}
    out = find_stragglers(times, {})
    assert set(out) == {"d", "e"}


def test_single_trainer_is_compared_with_its_plan() -> None:
    out = find_stragglers({"a": steady(0.4, 3)}, {"a": 0.1})
    assert out == {"a": "compute 400.0 ms/step over its last 3 steps vs 100.0 ms planned (4.0x)"}


def test_single_trainer_within_its_plan_is_not_flagged() -> None:
    assert find_stragglers({"a": steady(0.14, 3)}, {"a": 0.1}) == {}


def test_single_trainer_without_a_plan_is_not_judged() -> None:
    assert find_stragglers({"a": steady(10.0)}, {}) == {}
    assert find_stragglers({"a": steady(10.0)}, {"a": 0.0}) == {}


def test_prediction_for_unknown_names_is_ignored() -> None:
    times = {"a": steady(0.1), "b": steady(0.1)}
    assert find_stragglers(times, {"zz": 0.001}) == {}


def test_times_are_not_modified() -> None:
    times = {"a": [0.3, 0.1, 0.2], "b": [0.1, 0.1, 0.1]}
    before = {k: list(v) for k, v in times.items()}
    find_stragglers(times, {"a": 0.1, "b": 0.1})
    assert times == before


@settings(max_examples=100, deadline=None)
@given(
    base=st.floats(min_value=1e-3, max_value=10.0),
    n=st.integers(min_value=1, max_value=8),
    steps=st.integers(min_value=MIN_SAMPLES, max_value=8),
)
def test_property_identical_trainers_are_never_stragglers(base: float, n: int, steps: int) -> None:
    times = {f"n{i}": steady(base, steps) for i in range(n)}
    assert find_stragglers(times, {k: base for k in times}) == {}
    assert find_stragglers(times, {}) == {}


@settings(max_examples=100, deadline=None)
@given(
    times=st.dictionaries(
        st.sampled_from("abcdefgh"),
        st.lists(st.floats(min_value=1e-4, max_value=10.0), min_size=0, max_size=8),
        max_size=8,
    ),
    expected=st.dictionaries(st.sampled_from("abcdefgh"), st.floats(min_value=0.0, max_value=10.0), max_size=8),
)
def test_property_flagged_nodes_are_judged_trainers_with_a_reason(
    times: dict[str, list[float]], expected: dict[str, float]
) -> None:
    out = find_stragglers(times, expected)
    for name, reason in out.items():
        assert name in times
        assert len(times[name]) >= MIN_SAMPLES
        assert reason.startswith("compute ") and f"over its last {MIN_SAMPLES} steps" in reason


def test_a_slowdown_that_is_a_small_part_of_the_step_is_no_straggler() -> None:
    # 2x slower compute, but compute is 4 ms of a step that waits 100 ms on the network.
    times = {"a": [0.002] * MIN_SAMPLES, "b": [0.002] * MIN_SAMPLES, "c": [0.004] * MIN_SAMPLES}
    assert find_stragglers(times, {}, overhead_s=0.1) == {}
    assert set(find_stragglers(times, {}, overhead_s=0.0)) == {"c"}
    # It matters from an excess of MATTERS of the step on: 2 ms of 2 ms + 6 ms.
    edge = 0.002 / MATTERS - 0.002
    assert set(find_stragglers(times, {}, overhead_s=edge * 0.9)) == {"c"}
    assert find_stragglers(times, {}, overhead_s=edge * 1.1) == {}


def test_a_node_given_most_of_the_batch_by_an_estimated_plan_is_no_straggler() -> None:
    # A first plan on start-up estimates gave c 144 of 192 samples; its step is longer
    # because it computes more, at the same speed per sample as b (a's single sample is
    # mostly fixed cost). Its prediction, from the estimate, was far too low.
    times = {"a": steady(0.001), "b": steady(0.0026), "c": steady(0.0114)}
    expected = {"a": 0.0002, "b": 0.0015, "c": 0.0026}
    shares = {"a": 1, "b": 47, "c": 144}
    assert set(find_stragglers(times, expected)) == {"c"}  # per step it would be named
    assert find_stragglers(times, expected, shares=shares) == {}


def test_per_sample_a_truly_slow_node_under_unequal_shares_is_still_named() -> None:
    # c has twice b's share and is 4x slower per sample: named, with both figures.
    times = {"a": steady(0.1), "b": steady(0.1), "c": steady(0.8)}
    out = find_stragglers(times, {}, shares={"a": 10, "b": 10, "c": 20})
    assert set(out) == {"c"}
    assert "0.1 ms peers' median" not in out["c"]
    assert "40.00 ms/sample for 20 samples vs 10.00 ms peers' median" in out["c"]


def test_slow_per_sample_but_done_before_its_peers_holds_nobody_up() -> None:
    # a computes 1 sample at 10x the others' cost per sample, yet finishes first.
    times = {"a": steady(0.01), "b": steady(0.1), "c": steady(0.1)}
    assert find_stragglers(times, {}, shares={"a": 1, "b": 100, "c": 100}) == {}


def test_members_without_a_share_are_not_judged() -> None:
    times = {"a": steady(0.1), "b": steady(0.1), "c": steady(0.9)}
    assert find_stragglers(times, {}, shares={"a": 10, "b": 10, "c": 0}) == {}


def test_per_sample_the_step_is_as_long_as_the_slowest_peer_not_the_median_one() -> None:
    # A skewed first plan: a holds 144 samples, b, c, d 16 each. b is twice as slow per
    # sample as c and d, yet done 11 ms before a: it holds nobody up.
    times = {"a": steady(0.0144), "b": steady(0.0032), "c": steady(0.0016), "d": steady(0.0016)}
    assert find_stragglers(times, {}, shares={"a": 144, "b": 16, "c": 16, "d": 16}) == {}
    # Two slow nodes of equal shares both stand out: each is the other's slowest peer.
    times = {"a": steady(0.1), "b": steady(0.1), "c": steady(0.1), "d": steady(0.5), "e": steady(0.6)}
    assert set(find_stragglers(times, {}, shares=dict.fromkeys(times, 10))) == {"d", "e"}
