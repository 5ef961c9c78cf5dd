"""Target selection happens at configure time and fails loudly on contradictions."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hipferry.platform import torch_flavor

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")


def configure(tmp_path, *defs, env_target=None):
    import os
    env = dict(os.environ)
    env.pop("HIPFERRY_TARGET", None)
    if env_target:
        env["HIPFERRY_TARGET"] = env_target
    r = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(tmp_path / "b"), f"-DHIPFERRY_PYTHON={sys.executable}",
                        "-DHIPFERRY_BUILD_TESTS=OFF", *defs], capture_output=True, text=True, env=env, timeout=300)
    r.stderr = " ".join(r.stderr.split())  # CMake wraps long messages
    return r


def test_target_contradicting_torch_fails_with_advice(tmp_path):
    flavor = torch_flavor()
    other = {"cuda": "rocm", "rocm": "cuda", "cpu": "cuda"}[flavor]
    r = configure(tmp_path, env_target=other)
    assert r.returncode != 0
    assert f"HIPFERRY_TARGET={other} contradicts the installed torch" in r.stderr
    assert "HIPFERRY_TARGET=auto" in r.stderr


def test_unknown_target_fails(tmp_path):
    r = configure(tmp_path, "-DHIPFERRY_TARGET=metal")
    assert r.returncode != 0 and "expected one of auto, rocm, cuda, cpu" in r.stderr


def test_bad_torch_cuda_arch_list_fails(tmp_path):
    if torch_flavor() != "cuda" or not Path("/usr/local/cuda/bin/nvcc").exists() and not shutil.which("nvcc"):
        pytest.skip("needs a CUDA torch and nvcc")
    import os
    os.environ["TORCH_CUDA_ARCH_LIST"] = "sm90"
    try:
        r = configure(tmp_path)
    finally:
        del os.environ["TORCH_CUDA_ARCH_LIST"]
    assert r.returncode != 0 and "is not of the form 9.0 or 9.0+PTX" in r.stderr


def test_cpu_target_is_allowed_under_any_torch(tmp_path):
    r = configure(tmp_path, "-DHIPFERRY_TARGET=cpu")
    assert r.returncode == 0, r.stderr
    assert "hipferry: target cpu" in r.stdout


def test_build_never_writes_into_the_source_tree(tmp_path):
    before = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=ROOT, capture_output=True, text=True)
    configure(tmp_path, "-DHIPFERRY_TARGET=cpu")
    after = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=ROOT, capture_output=True, text=True)
    if before.returncode != 0:
        pytest.skip("not a git checkout")
    assert before.stdout == after.stdout


def test_test_hooks_are_not_part_of_the_production_module():
    """The test and benchmark hooks live in hipferry._C._testing, compiled in
    only with the tests (HIPFERRY_TEST_HOOKS); the module's own surface and
    the optimizer's signature carry none of them."""
    import inspect

    from hipferry import _C
    from hipferry.optim import OffloadAdamW
    for name in ("transfer_worker_sleep", "pool_bench_alloc_free", "raise_error"):
        assert not hasattr(_C, name), f"hipferry._C.{name} is a test hook in the production module"
    assert "_cpu_params_as_remote" not in inspect.signature(OffloadAdamW).parameters
    hooks = getattr(_C, "_testing", None)
    if hooks is not None:
        assert {"transfer_worker_sleep", "pool_bench_alloc_free", "raise_error"} <= set(dir(hooks))
