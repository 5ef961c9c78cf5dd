import gc

import pytest
import torch


def gpu_available() -> bool:
    import hipferry
    return torch.cuda.is_available() and hipferry.device_count() > 0


requires_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a GPU visible to torch and hipferry")


def installed_test_hooks():
    """hipferry._C._testing: hooks built into the module only with the tests
    (HIPFERRY_TEST_HOOKS); None in a production build."""
    from hipferry import _C
    return getattr(_C, "_testing", None)


requires_test_hooks = pytest.mark.skipif(installed_test_hooks() is None,
                                         reason="needs a build with the test hooks (HIPFERRY_TEST_HOOKS=ON)")


@pytest.fixture
def pool():
    """A 64 MiB pool of its own, checked and closed after the test (modules with
    other needs define their own `pool`)."""
    import hipferry
    p = hipferry.PinnedPool(capacity="64MiB")
    yield p
    gc.collect()
    p.check_invariants()
    p.close()
