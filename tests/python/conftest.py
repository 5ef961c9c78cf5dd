import gc

import pytest
import torch


def gpu_available() -> bool:
    import hipferry
    return torch.cuda.is_available() and hipferry.device_count() > 0


requires_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a GPU visible to torch and hipferry")


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
