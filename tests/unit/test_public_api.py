"""The public API is listed once, in unbroken.__all__."""

from __future__ import annotations

import unbroken
from unbroken import errors


def test_every_public_name_exists() -> None:
    missing = [name for name in unbroken.__all__ if not hasattr(unbroken, name)]
    assert missing == []


def test_all_is_sorted_and_has_no_duplicates() -> None:
    assert list(unbroken.__all__) == sorted(unbroken.__all__)
    assert len(set(unbroken.__all__)) == len(unbroken.__all__)


def test_star_import_gives_exactly_the_public_names() -> None:
    namespace: dict[str, object] = {}
    exec("from unbroken import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(unbroken.__all__)


def test_every_exception_of_the_tree_is_public_and_an_unbroken_error() -> None:
    tree = [
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == errors.__name__
    ]
    assert len(tree) >= 10
    for exc in tree:
        assert exc.__name__ in unbroken.__all__
        assert issubclass(exc, unbroken.UnbrokenError)
        assert exc.__doc__, f"{exc.__name__} has no docstring"
        assert exc.__name__ in (errors.__doc__ or ""), f"{exc.__name__} is not drawn in the tree"


def test_config_errors_are_value_errors_for_callers_that_catch_those() -> None:
    assert issubclass(unbroken.ConfigError, ValueError)
    assert issubclass(unbroken.Expelled, unbroken.EpochAborted)


def test_version_is_a_string() -> None:
    assert isinstance(unbroken.__version__, str) and unbroken.__version__.count(".") == 2
