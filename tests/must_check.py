"""Like bbolt's MustCheck: every fixture that opens a store runs its full check on teardown.

The check fails the test, listing each problem, if the store is inconsistent, so a test that
leaves a store damaged is caught even when it never checks it itself. A test that damages a store
on purpose (and leaves it so) opts out with `@pytest.mark.damages_store`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixd import Store


def checks_on_teardown(request: pytest.FixtureRequest) -> bool:
    """Whether this test's fixtures check their stores on teardown (no `damages_store`)."""
    return request.node.get_closest_marker("damages_store") is None


def assert_store_checks(store: Store) -> None:
    """Fail loudly, with every problem listed, if `store` is not consistent."""
    problems = store.check()
    if problems:
        listed = "\n".join(f"  {problem}" for problem in problems)
        pytest.fail(
            f"the store at {store.path} fails its check on teardown ({len(problems)} problem(s); "
            f"a test that damages it on purpose is marked damages_store):\n{listed}",
            pytrace=False,
        )


def assert_data_dir_checks(path: Path) -> None:
    """`assert_store_checks` for the store a stopped daemon left in `path`."""
    with Store.open(path, create=False) as store:
        assert_store_checks(store)
