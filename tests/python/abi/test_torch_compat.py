"""The import check: which torch a build runs under, decided before hipferry._C loads."""
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import hipferry
from hipferry import torch_compat


def record(**changes):
    base = dict(target="cuda", runtime_major=13, torch_built_against="2.15.0+cu132",
                torch_abi="libtorch C++ ABI of torch 2.15.0", torch_oldest="2.15", torch_newest="2.15",
                torch_newer_loads=False)
    return SimpleNamespace(**dict(base, **changes))


def one_sentence(message):
    assert "\n" not in message and message.endswith(".") and message.count(": ") == 1, message
    return message


def test_minor_of_reads_every_spelling_torch_uses():
    assert torch_compat.minor_of("2.15.0+cu132") == (2, 15)
    assert torch_compat.minor_of("2.14.0a0+git1234abc") == (2, 14)
    assert torch_compat.minor_of("2.13") == (2, 13)
    assert torch_compat.minor_of("6.4.43482-0f2d60242") == (6, 4)  # torch.version.hip
    with pytest.raises(ValueError, match="not a torch version"):
        torch_compat.minor_of("nightly")


def test_the_torch_it_was_built_for_passes():
    assert torch_compat.mismatch(record(), "2.15.0+cu132", None, "13.2") is None
    assert torch_compat.mismatch(record(), "2.15.1", None, "13.0") is None  # a patch release shares the ABI


@pytest.mark.parametrize("version", ["2.14.1+cu130", "2.13.0", "2.16.0", "3.0.0"])
def test_a_torch_outside_the_range_is_refused_naming_both(version):
    message = one_sentence(torch_compat.mismatch(record(), version, None, "13.0"))
    assert "supports torch 2.15 (libtorch C++ ABI of torch 2.15.0)" in message
    assert f"has torch {version}" in message and "rebuild hipferry" in message


def test_a_forward_compatible_build_takes_newer_torch_but_not_older():
    stable = record(torch_oldest="2.13", torch_newest="2.15", torch_newer_loads=True, torch_abi="stable ABI")
    for ok in ("2.13.0", "2.14.1", "2.15.0", "2.16.0"):
        assert torch_compat.mismatch(stable, ok, None, "13.0") is None, ok
    message = one_sentence(torch_compat.mismatch(stable, "2.12.1", None, "13.0"))
    assert "supports torch 2.13 and newer (checked up to 2.15)" in message and "has torch 2.12.1" in message
    assert torch_compat.supported_range(record(torch_oldest="2.13", torch_newest="2.15")) == "2.13 to 2.15"


def test_a_rocm_build_under_a_cuda_torch_and_the_reverse_are_refused():
    rocm = record(target="rocm", runtime_major=6)
    message = one_sentence(torch_compat.mismatch(rocm, "2.15.0+cu132", None, "13.2"))
    assert "built for ROCm but torch 2.15.0+cu132 is a CUDA build" in message
    message = one_sentence(torch_compat.mismatch(record(), "2.15.0+rocm6.4", "6.4.43482", None))
    assert "built for CUDA but torch 2.15.0+rocm6.4 is a ROCm build" in message


def test_a_gpu_build_under_a_cpu_only_torch_loads():
    # Its CPU paths work; the doctor says the GPU ones cannot.
    assert torch_compat.mismatch(record(), "2.15.0+cpu", None, None) is None
    assert torch_compat.mismatch(record(target="rocm", runtime_major=6), "2.15.0+cpu", None, None) is None


def test_another_runtime_major_is_refused():
    message = one_sentence(torch_compat.mismatch(record(), "2.15.0+cu126", None, "12.6"))
    assert "built with CUDA 13 but torch 2.15.0+cu126 uses CUDA 12.6" in message
    rocm = record(target="rocm", runtime_major=6)
    message = one_sentence(torch_compat.mismatch(rocm, "2.15.0+rocm7.0", "7.0.51831", None))
    assert "built with ROCm/HIP 6 but torch 2.15.0+rocm7.0 uses ROCm/HIP 7.0.51831" in message
    # The CPU-only build links no runtime: any torch flavor.
    assert torch_compat.mismatch(record(target="cpu", runtime_major=None), "2.15.0+cu126", None, "12.6") is None


def test_this_build_runs_under_this_torch_and_says_so():
    b = hipferry.build_info()
    assert b["torch_supported"] == torch_compat.supported_range(torch_compat.load_build_record())
    assert torch_compat.minor_of(b["torch_version_built_against"]) == torch_compat.minor_of(torch.__version__) or \
        torch_compat.load_build_record().torch_newer_loads
    assert b["torch_abi"]


def import_under(patch):
    """Runs `import hipferry` in a fresh interpreter after `patch` edits torch's version."""
    code = textwrap.dedent(f"""
        import sys, torch
        {patch}
        try:
            import hipferry
        except ImportError as e:
            print("REFUSED", "hipferry._C" in sys.modules, str(e))
        else:
            print("IMPORTED")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_refuses_a_torch_below_the_floor_before_the_module_loads():
    out = import_under("torch.__version__ = '2.1.0'")
    assert out.startswith("REFUSED False "), out  # False: hipferry._C never loaded
    one_sentence(out[len("REFUSED False "):])
    assert "has torch 2.1.0" in out


def test_import_refuses_the_other_vendors_torch():
    target = hipferry.build_info()["target"]
    if target == "cpu":
        pytest.skip("the CPU-only build runs under any torch flavor")
    other = "torch.version.hip, torch.version.cuda = None, '13.0'" if target == "rocm" else \
        "torch.version.hip, torch.version.cuda = '6.4.43482', None"
    out = import_under(other)
    assert out.startswith("REFUSED False ") and "is a " in out, out


def test_import_does_not_load_torch_compile():
    # torch._dynamo costs seconds to import; a program that never compiles must not pay it for hipferry.
    code = "import sys, torch; assert 'torch._dynamo' not in sys.modules; import hipferry; " \
           "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
