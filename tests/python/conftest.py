import pytest
import torch


def gpu_available() -> bool:
    import hipferry
    return torch.cuda.is_available() and hipferry.device_count() > 0


requires_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a GPU visible to torch and hipferry")
