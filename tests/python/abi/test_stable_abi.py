"""hipferry._C is built on LibTorch's stable ABI only (Note [tensor bridge],
csrc/torch/stable.h): it must not reference one symbol of torch's C++ API,
whose ABI changes with every minor release, nor need libtorch_python. These
tests read the module's dynamic symbol table and its needed libraries."""
import re
import shutil
import subprocess
import sys

import pytest
import torch

import hipferry
from hipferry import _C
from conftest import installed_test_hooks, requires_test_hooks

nm = shutil.which("nm")
readelf = shutil.which("readelf")
requires_binutils = pytest.mark.skipif(nm is None or readelf is None, reason="needs nm and readelf (binutils)")

# Namespaces of torch's C++ API, as they appear in demangled symbol names.
TORCH_CXX = re.compile(r"^(at|c10|torch|caffe2)::|[\s(<,](at|c10|torch|caffe2)::")


def undefined_symbols(path):
    out = subprocess.run([nm, "-D", "--undefined-only", "-C", path], check=True, capture_output=True, text=True).stdout
    return [line.split(None, 1)[1] for line in out.splitlines() if line.strip() and len(line.split(None, 1)) == 2]


def needed_libraries(path):
    out = subprocess.run([readelf, "-d", path], check=True, capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)


@requires_binutils
def test_the_module_references_no_torch_cxx_symbol():
    symbols = undefined_symbols(_C.__file__)
    assert symbols, "nm listed no undefined symbol at all: the check would prove nothing"
    cxx = [s for s in symbols if TORCH_CXX.search(s)]
    assert not cxx, f"{len(cxx)} torch C++ symbols in {_C.__file__}: {cxx[:10]}"
    # What it takes from torch is the stable C shim, and it does take it.
    shim = [s for s in symbols if s.startswith(("aoti_torch_", "torch_"))]
    assert any(s.startswith("torch_call_dispatcher") for s in shim), shim
    assert any(s.startswith("torch_library_impl") for s in shim), shim


@requires_binutils
def test_the_module_needs_libtorch_cpu_only():
    needed = needed_libraries(_C.__file__)
    torch_libs = sorted(n for n in needed if "torch" in n or "c10" in n)
    assert torch_libs == ["libtorch_cpu.so"], needed


def test_the_symbol_check_sees_a_torch_cxx_symbol():
    # The pattern that keeps the module stable-only does match torch's C++ names.
    assert TORCH_CXX.search("at::_ops::empty_memory_format::call(c10::ArrayRef<c10::SymInt>)")
    assert TORCH_CXX.search("void foo(c10::Device)")
    assert not TORCH_CXX.search("torch_call_dispatcher")
    assert not TORCH_CXX.search("aoti_torch_get_data_ptr")


def test_the_build_record_says_stable_abi_from_2_13():
    b = hipferry.build_info()
    assert "stable ABI" in b["torch_abi"], b
    assert b["torch_supported"].startswith("2.13"), b


def test_the_tensor_bridge_follows_the_torch_release():
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    # torch 2.13 has no pyobject shims: its THPVariable layout and THPVariable_Wrap (Note [tensor bridge]).
    expected = "pyobject shim" if (major, minor) >= (2, 14) else "torch 2.13 THPVariable"
    assert hipferry.build_info()["tensor_bridge"] == expected


@requires_test_hooks
def test_the_dtype_table_agrees_with_torch():
    # hipferry names dtypes and sizes them from a table of its own (the stable
    # headers print "Float", not "torch.float32"): each entry must be the
    # dtype torch makes from it, with torch's element size.
    rows = installed_test_hooks().dtype_table()
    assert len(rows) >= 20, rows
    names = set()
    for name, size, made in rows:
        dtype = getattr(torch, name.removeprefix("torch."))
        assert isinstance(dtype, torch.dtype) and str(dtype) == name, name
        assert dtype.itemsize == size, (name, size)
        if made is not None:  # quantized dtypes come back without a tensor
            assert made.dtype == dtype and made.shape == (2,), (name, made)
        names.add(name)
    # Every dtype the ops take or name in errors is in the table.
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.bool,
                  torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2, torch.qint8):
        assert str(dtype) in names, dtype


def test_fallbacks_across_the_c_shim_write_nothing_to_stderr():
    # torch's STABLE_TORCH_ERROR_CODE_CHECK prints every error that crosses the
    # C shim with its backtrace. The transfer engine expects one (the lazy clone
    # of memory with a deleter of its own falls back to an alias): prefetching
    # pool memory and numpy memory must stay silent and copy exactly.
    code = (
        "import numpy, torch, hipferry\n"
        "pool = hipferry.PinnedPool()\n"
        "n = 1 << 22\n"  # 16 MiB: large sources are held, not staged at once
        "a = pool.empty(n); a.copy_(torch.arange(float(n)))\n"
        "b = torch.from_numpy(numpy.arange(n, dtype=numpy.float32))\n"
        "got = hipferry.prefetch([a, b], 'cpu').wait()\n"
        "assert torch.equal(got[0], a) and torch.equal(got[1], b)\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert "Exception across libtorch C API boundary" not in done.stderr, done.stderr[-3000:]
    assert "frame #" not in done.stderr, done.stderr[-3000:]
