"""Shared by the pool tests (test_pool.py, test_pool_arguments.py): a pool of
their own, checked and closed after the test unless the test closed it."""
import pytest

import hipferry


@pytest.fixture
def pool():
    p = hipferry.PinnedPool(capacity="256MiB")
    yield p
    if not p.closed:
        p.check_invariants()
        p.close()
