"""The one majority rule the membership counts by (`unbroken.control.roster`)."""

from __future__ import annotations

import pytest

from unbroken.control.roster import majority, most_others


@pytest.mark.parametrize(("voters", "need"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (1000, 501)])
def test_most_of_the_voters_is_more_than_half(voters: int, need: int) -> None:
    assert majority(voters) == need


@pytest.mark.parametrize(
    ("group", "never_alone", "need"),
    [
        (2, True, 2),  # a pair: one word against another condemns nobody
        (2, False, 1),  # ...unless the word is on the others' wires alone (one of a pair)
        (3, True, 2),
        (4, True, 2),
        (5, True, 3),
        (5, False, 3),
        (9, False, 5),
    ],
)
def test_a_member_is_kept_out_on_most_of_the_others_word(group: int, never_alone: bool, need: int) -> None:
    assert most_others(group, never_alone=never_alone) == need
