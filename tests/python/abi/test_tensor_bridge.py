"""The tensor bridge (Note [tensor bridge], csrc/torch/tensor_bridge.h): tensors
cross between Python and the stable-ABI module either through torch's
pyobject shims (torch >= 2.14) or through the stash ops (torch 2.13, or
HIPFERRY_TENSOR_BRIDGE=op). Both must hand over the very tensors (same
storage, same Python type of result), keep None as None where allowed, and
reject what is not a tensor by name, before anything runs. The op path runs
here in a subprocess on torch releases that have the shims."""
import os
import subprocess
import sys
import textwrap

import torch

import hipferry

# Run under either bridge: every check raises AssertionError on failure.
CHECKS = textwrap.dedent("""
    import torch, hipferry
    from hipferry import _C
    bridge = hipferry.build_info()["tensor_bridge"]
    # Tensors in, tensors out: a host transfer returns new tensors with the sources' values.
    xs = [torch.arange(n, dtype=torch.float32) for n in (0, 3, 1 << 18)]
    ys = hipferry.prefetch(xs, "cpu").wait()
    assert [type(y) for y in ys] == [torch.Tensor] * 3
    assert all(torch.equal(x, y) for x, y in zip(xs, ys))
    assert all(y.data_ptr() != x.data_ptr() for x, y in zip(xs, ys) if x.numel())
    # Converting on the way, from a view (made contiguous on the way in).
    v = torch.randn(64, 64)[:, ::2]
    (h,) = hipferry.offload([v], dtype=torch.bfloat16).wait()
    assert h.dtype == torch.bfloat16 and torch.equal(h, v.to(torch.bfloat16))
    # In place through the bridge: the kernel writes the caller's own tensors.
    p = torch.randn(1000); g = torch.randn(1000); m = torch.zeros(1000); s = torch.zeros(1000)
    before = p.clone()
    _C._adamw_step_(p, g, m, s, None, None, 1, 1e-2, 0.9, 0.999, 1e-8, 0.0, False, False)
    assert not torch.equal(p, before) and m.abs().sum() > 0
    # A parameter's tensor keeps its identity through the bridge.
    w = torch.nn.Parameter(torch.randn(10))
    (w2,) = hipferry.prefetch([w.detach()], "cpu").wait()
    assert torch.equal(w2, w.detach())
    # Not a tensor: TypeError naming the argument, nothing started.
    before = hipferry.transfer_stats()["transfers"]
    try:
        _C.start_offload([torch.zeros(2), "x"], None, 0)
    except TypeError as e:
        assert "[1]" in str(e) and "str" in str(e), e
    else:
        raise AssertionError("a str among the tensors was accepted")
    assert hipferry.transfer_stats()["transfers"] == before
    print("bridge", bridge, "ok")
""")


def run_checks(env_extra):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=300)


def test_the_bridge_in_use_hands_tensors_over():
    r = run_checks({})
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"bridge {hipferry.build_info()['tensor_bridge']} ok" in r.stdout


def test_the_stash_op_path_hands_tensors_over():
    r = run_checks({"HIPFERRY_TENSOR_BRIDGE": "op"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bridge stash op ok" in r.stdout


def test_the_stash_ops_are_apart_from_hipferrys_ops():
    # Internal ops, never traced: not in the public namespace that opcheck and the fake kernels cover.
    assert hasattr(torch.ops.hipferry_bridge, "stash")
    assert "stash" not in dir(torch.ops.hipferry)
