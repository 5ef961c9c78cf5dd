"""OffloadAdamW(state_dir=...): the optimizer state in files. The disk step runs
the same fused loop as the in-memory optimizer over chunks read from and
written to disk, so the two agree bit for bit; resuming from the folder gives
the run that never stopped."""
import logging
import os

import pytest
import torch

from hipferry import _C
from hipferry.optim import DiskOptions, OffloadAdamW

from conftest import requires_gpu

from disk_helpers import (CHUNK, assert_same_params, assert_same_state, disk_opt, make_params, ram_opt,
                          set_grads, state_tensors, train)


def clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.uint8])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_disk_steps_equal_the_in_memory_optimizer(tmp_path, state_dtype, amsgrad):
    a, b = make_params(), make_params()
    ram = ram_opt(a, amsgrad=amsgrad, state_dtype=state_dtype)
    disk = disk_opt(b, tmp_path, amsgrad=amsgrad, state_dtype=state_dtype)
    for k in range(4):
        for params, opt in ((a, ram), (b, disk)):
            set_grads(params, k)
            opt.step()
        assert_same_params(a, b)
    assert_same_state(state_tensors(ram), state_tensors(disk))
    stats = disk.memory_stats()
    assert stats["disk_steps"] == 4 and stats["io_backend"] in ("io_uring", "threads")
    assert stats["host_state_bytes"] == stats["disk_window_bytes"]  # the window: no state in RAM


def test_groups_maximize_and_a_parameter_without_grad(tmp_path):
    a, b = make_params(), make_params()
    groups = lambda ps: [{"params": ps[:3], "maximize": True}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.0}]
    ram, disk = ram_opt(groups(a)), disk_opt(groups(b), tmp_path)
    for k in range(3):
        for params, opt in ((a, ram), (b, disk)):
            set_grads(params, k)
            params[1].grad = None if k == 1 else params[1].grad  # not stepped in step 1
            opt.step()
    assert_same_params(a, b)
    assert_same_state(state_tensors(ram), state_tensors(disk))


def test_a_write_to_the_parameter_is_taken(tmp_path):
    """p.data.copy_ (no version bump) between steps: the disk step adopts it, as the
    in-memory optimizer's fused pass does."""
    a, b = make_params(), make_params()
    ram, disk = ram_opt(a), disk_opt(b, tmp_path)
    for k in range(3):
        for params, opt in ((a, ram), (b, disk)):
            set_grads(params, k)
            opt.step()
            if k == 1:
                params[0].data[:1000].copy_(torch.linspace(-1, 1, 1000))
                params[1].data.mul_(0.5)
    assert_same_params(a, b)
    assert torch.equal(b[0].detach()[:1000], a[0].detach()[:1000])


def test_resume_gives_the_run_that_never_stopped(tmp_path):
    ref = make_params()
    opt = ram_opt(ref)
    train(opt, ref, range(5))
    first = make_params()
    d = disk_opt(first, tmp_path)
    train(d, first, range(3))
    del d
    fresh = make_params(seed=7)  # other values: resume restores them from the folder
    d = disk_opt(fresh, tmp_path, disk=DiskOptions(chunk_numel=CHUNK, window_bytes=8 * 16 * CHUNK, resume=True))
    assert [float(d.state[p]["step"]) for p in fresh] == [3.0] * len(fresh)
    assert_same_params(first, fresh)
    train(d, fresh, range(3, 5))
    assert_same_params(ref, fresh)


def test_state_dict_is_file_backed_and_loads_back(tmp_path):
    a = make_params()
    d = disk_opt(a, tmp_path / "run")
    train(d, a, range(2))
    sd = d.state_dict()
    m = sd["state"][0]["exp_avg"]
    assert m.shape == a[0].shape and not m.is_shared()
    torch.save(sd, tmp_path / "opt.pt")
    ram_twin = clone(a)
    ram = ram_opt(ram_twin)
    ram.load_state_dict(torch.load(tmp_path / "opt.pt"))
    other = clone(a)
    d2 = disk_opt(other, tmp_path / "other")
    d2.load_state_dict(torch.load(tmp_path / "opt.pt"))
    for params, opt in ((a, d), (ram_twin, ram), (other, d2)):
        train(opt, params, range(2, 4))
    assert_same_params(a, ram_twin)
    assert_same_params(a, other)
    assert_same_state(state_tensors(d), state_tensors(d2))


def test_float32_state_loads_into_8bit_disk_state(tmp_path):
    a = make_params()
    ram = ram_opt(a)
    train(ram, a, range(2))
    b = clone(a)
    d = disk_opt(b, tmp_path, state_dtype=torch.uint8)
    d.load_state_dict(ram.state_dict())
    st = d.state_dict()["state"][0]
    assert st["exp_avg"].dtype == torch.uint8 and "exp_avg_absmax" in st
    torch.testing.assert_close(st["step"], ram.state_dict()["state"][0]["step"])


def test_snapshot_resumes(tmp_path):
    a = make_params()
    d = disk_opt(a, tmp_path / "run")
    train(d, a, range(2))
    d.snapshot(tmp_path / "snap")
    after_two = clone(a)
    train(d, a, range(2, 4))
    del d
    b = make_params(seed=3)
    opts = DiskOptions(chunk_numel=CHUNK, window_bytes=8 * 16 * CHUNK, resume=True)
    s = disk_opt(b, tmp_path / "snap", disk=opts)
    assert_same_params(after_two, b)
    train(s, b, range(2, 4))
    assert_same_params(a, b)
    with pytest.raises(ValueError, match="not empty"):
        s.snapshot(tmp_path / "run")


def test_bytes_per_step_and_the_wear_warning(tmp_path, caplog):
    a, b = make_params(dtypes=(torch.float32,)), make_params(dtypes=(torch.float32,))
    f32, q8 = disk_opt(a, tmp_path / "f32"), disk_opt(b, tmp_path / "q8", state_dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, logger="hipferry.optim"):
        train(f32, a, range(2))
    assert sum("drive" in r.getMessage() for r in caplog.records) == 1  # once, at the first write
    train(q8, b, range(2))
    w32, w8 = (o.memory_stats()["disk_bytes_written_per_step"] for o in (f32, q8))
    numel = sum(p.numel() for p in a)
    assert 12 * numel <= w32 <= 12 * numel + 3 * 4096 * len(a) * 2  # master, m, v; page padding
    assert w8 <= 0.55 * w32


def test_a_folder_in_use_of_another_model_or_with_state_is_refused(tmp_path):
    a = make_params()
    d = disk_opt(a, tmp_path)
    with pytest.raises(RuntimeError, match="in use by another optimizer"):
        disk_opt(make_params(), tmp_path, disk=DiskOptions(chunk_numel=CHUNK, resume=True))
    train(d, a, range(1))
    del d
    with pytest.raises(ValueError, match="already holds optimizer state"):
        disk_opt(make_params(), tmp_path)
    wrong = make_params()
    wrong[2] = torch.nn.Parameter(torch.zeros(4097, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="parameter 2: the folder holds dtype='float32'"):
        disk_opt(wrong, tmp_path, disk=DiskOptions(chunk_numel=CHUNK, resume=True))
    before = {n: os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path)}
    d = disk_opt(make_params(), tmp_path, disk=DiskOptions(chunk_numel=CHUNK, resume=True))  # still loadable
    assert float(d.state[d.param_groups[0]["params"][0]]["step"]) == 1.0
    assert before["journal"] == os.path.getsize(tmp_path / "journal")


@pytest.mark.parametrize("kwargs, match", [
    (dict(overlap="backward"), "overlap='backward' is not built for state on disk"),
    (dict(step_on="gpu"), "step_on='gpu' is not built for state on disk"),
    (dict(disk=DiskOptions(chunk_numel=1000)), "chunk_numel must be a positive multiple of 262144"),
    (dict(disk=DiskOptions(queue_depth=0)), "queue_depth must be a positive"),
    (dict(disk=DiskOptions(io_backend="aio")), "io_backend must be"),
    (dict(disk=DiskOptions(window_bytes=1 << 20)), "window_bytes=1048576 holds fewer than 2 chunks"),
    (dict(disk={"window_bytes": 1}), "disk must be a hipferry.optim.DiskOptions"),
])
def test_bad_disk_arguments_are_refused_before_anything_is_written(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffloadAdamW(make_params(), state_dir=str(tmp_path / "x"), **kwargs)
    assert not (tmp_path / "x").exists() or not any(n.endswith(".0") for n in os.listdir(tmp_path / "x"))


def test_disk_options_without_a_folder_and_amsgrad_switched_on(tmp_path):
    with pytest.raises(ValueError, match="needs state_dir"):
        OffloadAdamW(make_params(), disk=DiskOptions())
    a = make_params()
    d = disk_opt(a, tmp_path)
    d.param_groups[0]["amsgrad"] = True
    set_grads(a, 0)
    before = [p.detach().clone() for p in a]
    with pytest.raises(ValueError, match="amsgrad cannot be switched on for state on disk"):
        d.step()
    assert_same_params(before, a)


def test_buffered_io_where_o_direct_is_refused():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    import tempfile
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        a, b = make_params(), make_params()
        d, ram = disk_opt(a, folder), ram_opt(b)
        train(d, a, range(2))
        train(ram, b, range(2))
        assert_same_params(a, b)
        stats = d.memory_stats()
        if stats["direct_io"]:
            pytest.skip("/dev/shm accepts O_DIRECT here")
        assert "O_DIRECT" in stats["direct_io_note"]
        del d


def test_crc32c_matches_the_reference_package():
    crc32c = pytest.importorskip("crc32c")
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 7, 8, 9, 63, 64, 65, 4096, 100_003):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert _C._crc32c(data) == crc32c.crc32c(bytes(data.numpy()))
    assert _C._crc32c(torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)) == 0xE3069283


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_parameters_step_on_the_host_with_state_on_disk(tmp_path, dtype):
    """GPU parameters (step_on='cpu'): host gradient copies, the disk step into a host buffer, the new
    values back to the device; equal to the in-memory optimizer's CPU engine."""
    a = [torch.nn.Parameter(p.detach().to("cuda", dtype)) for p in make_params()]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ram, disk = ram_opt(a, step_on="cpu"), disk_opt(b, tmp_path, step_on="cpu")
    for k in range(3):
        for params, opt in ((a, ram), (b, disk)):
            set_grads(params, k)
            opt.step()
        torch.cuda.synchronize()
        assert_same_params([p.cpu() for p in a], [p.cpu() for p in b])
    b[0].data.mul_(0.5)  # a write on the device is taken at the next step
    a[0].data.mul_(0.5)
    for params, opt in ((a, ram), (b, disk)):
        set_grads(params, 3)
        opt.step()
    torch.cuda.synchronize()
    assert_same_params([p.cpu() for p in a], [p.cpu() for p in b])
