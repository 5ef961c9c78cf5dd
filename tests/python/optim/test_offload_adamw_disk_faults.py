"""Faults of the disk state store: I/O errors and short transfers in a step (a
fault-injecting backend of the test build), a torn chunk, a deleted or truncated
file, no space at creation, and kills at random moments (subprocesses): the
parameters and the state are as before the failed step, or the folder resumes."""
import errno
import os
import subprocess
import sys
import textwrap

import pytest

from hipferry import _C

from conftest import installed_test_hooks, requires_test_hooks
from disk_helpers import (CHUNK, assert_same_params, assert_same_state, disk_opt, make_params, ram_opt, set_grads,
                          state_tensors, train)

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def faults():
    hooks = installed_test_hooks()
    yield hooks
    if hooks is not None:
        hooks.disk_faults("any", count=0)


@requires_test_hooks
@pytest.mark.parametrize("op, after", [("read", 0), ("read", 9), ("write", 0), ("write", 7), ("any", 25)])
def test_an_io_error_in_a_step_changes_nothing(tmp_path, faults, op, after):
    a, b = make_params(), make_params()
    d, ram = disk_opt(a, tmp_path), ram_opt(b)
    train(d, a, range(2))
    train(ram, b, range(2))
    before_state = state_tensors(d)
    set_grads(a, 2)
    faults.disk_faults(op, after=after, error=errno.EIO)
    with pytest.raises(OSError, match="Input/output error") as info:
        d.step()
    assert info.value.errno == errno.EIO and str(tmp_path) in str(info.value)
    assert faults.disk_faults_fired() == 1
    assert_same_params(b, a)  # as before the step
    assert_same_state(before_state, state_tensors(d))
    assert [float(d.state[p]["step"]) for p in a] == [2.0] * len(a)
    d.step()  # the same step again, now without the fault
    set_grads(b, 2)
    ram.step()
    assert_same_params(b, a)


@requires_test_hooks
def test_short_transfers_are_finished(tmp_path, faults):
    a, b = make_params(), make_params()
    d, ram = disk_opt(a, tmp_path), ram_opt(b)
    faults.disk_faults("any", after=3, error=0, count=40)  # 40 requests move half their bytes
    train(d, a, range(3))
    train(ram, b, range(3))
    assert faults.disk_faults_fired() == 40
    assert_same_params(b, a)


@requires_test_hooks
def test_no_space_while_the_journal_is_written_changes_nothing(tmp_path, monkeypatch):
    from hipferry.optim.disk import journal
    a, b = make_params(), make_params()
    d, ram = disk_opt(a, tmp_path), ram_opt(b)
    train(d, a, range(1))
    train(ram, b, range(1))
    real_replace = os.replace

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", dst)
    monkeypatch.setattr(journal.os, "replace", full)
    set_grads(a, 1)
    with pytest.raises(OSError, match="No space left"):
        d.step()
    monkeypatch.setattr(journal.os, "replace", real_replace)
    assert_same_params(b, a)
    train(d, a, range(1, 3))
    train(ram, b, range(1, 3))
    assert_same_params(b, a)


def test_a_torn_chunk_is_an_error_naming_file_and_offset(tmp_path):
    a = make_params()
    d = disk_opt(a, tmp_path)
    train(d, a, range(2))  # step 2 wrote slot 0: the journal names it
    before = [p.detach().clone() for p in a]
    offset = CHUNK * 4 + 100  # parameter 0's second chunk of exp_avg
    with open(tmp_path / "exp_avg.0", "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    set_grads(a, 2)
    with pytest.raises(_C.ChecksumError, match=rf"checksum mismatch in .*exp_avg\.0 at offset {CHUNK * 4}"):
        d.step()
    assert_same_params(before, a)
    with pytest.raises(_C.ChecksumError):
        d.state_dict()


@pytest.mark.parametrize("how", ["delete", "truncate"])
def test_a_state_file_deleted_or_truncated_while_training(tmp_path, how):
    a = make_params()
    d = disk_opt(a, tmp_path)
    train(d, a, range(1))
    if how == "delete":
        os.remove(tmp_path / "exp_avg_sq.1")
    else:
        os.truncate(tmp_path / "exp_avg_sq.1", 4096)
    set_grads(a, 1)
    with pytest.raises(RuntimeError, match=r"exp_avg_sq\.1 was (deleted|truncated) while training"):
        d.step()


def run_child(code: str, *args, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300, **kw)


def test_no_space_at_creation_raises_and_keeps_nothing(tmp_path):
    """A file size limit (RLIMIT_FSIZE) makes fallocate fail as a full disk would."""
    r = run_child("""
        import errno, resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        from disk_helpers import disk_opt, make_params
        try:
            disk_opt(make_params(), sys.argv[1])
        except OSError as e:
            print("raised", e.errno, e)
        """, tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"raised {errno.EFBIG}" in r.stdout and str(tmp_path) in r.stdout, r.stdout
    leftovers = {n: os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path) if n != "lock"}
    assert "journal" not in leftovers and "manifest.json" not in leftovers
    assert all(size == 0 for size in leftovers.values()), leftovers
