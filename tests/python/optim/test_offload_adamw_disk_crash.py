"""Kills at random moments (SIGKILL of a process stepping with its state on disk, 50
times): every time, the folder resumes, its journal names a step k, and every
parameter and state tensor is exactly the one of an uninterrupted run after k
steps: from before the step that was killed, or after it, never a mix and never
corrupt. The last resume finishes the run and equals the uninterrupted one."""
import gc
import multiprocessing
import os
import random
import signal
import time

import pytest


from disk_helpers import crash_child, digest, disk_opt, make_params, ram_opt, resume_options, train

KILLS = 50
LAST_STEP = 400


class Reference:
    """The uninterrupted run, stepped as far as asked (digests of each step)."""

    def __init__(self):
        self.params = make_params()
        self.opt = ram_opt(self.params)
        self.digests = [digest(self.params, self.opt)]

    def at(self, k: int) -> str:
        while len(self.digests) <= k:
            train(self.opt, self.params, range(len(self.digests) - 1, len(self.digests)))
            self.digests.append(digest(self.params, self.opt))
        return self.digests[k]


def resumed_digest(folder: str) -> tuple:
    params = make_params(seed=99)  # other values: the folder restores them
    opt = disk_opt(params, folder, disk=resume_options())
    k = opt.memory_stats()["disk_steps"]
    out = (k, digest(params, opt))
    del opt
    gc.collect()  # (releases the folder's lock)
    return out


@pytest.mark.slow
def test_kills_at_random_moments_leave_a_folder_that_resumes_exactly(tmp_path):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "hipferry", "disk_helpers", "pytest"])  # (children re-import __main__)
    rng = random.Random(1234)
    ref, folder, seen, timings = Reference(), str(tmp_path / "state"), set(), []
    for trial in range(KILLS):
        t0 = time.monotonic()
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=crash_child, args=(folder, LAST_STEP, child))
        proc.start()
        assert parent.poll(120), "the child never got ready"
        start = parent.recv()
        # mostly inside a step (a few ms each), sometimes between steps
        proc.join(rng.uniform(0.0, 0.12))
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        t1 = time.monotonic()
        k, got = resumed_digest(folder)
        timings.append((t1 - t0, time.monotonic() - t1))
        assert k >= start, (trial, k, start)
        assert got == ref.at(k), f"kill {trial}: the state after {k} steps is not the uninterrupted run's"
        seen.add(k)
    print("child s, resume+check s (mean):", [sum(t) / len(t) for t in zip(*timings)])
    assert len(seen) >= KILLS // 3, f"the kills landed on too few distinct steps: {sorted(seen)}"
    params = make_params(seed=5)
    opt = disk_opt(params, folder, disk=resume_options())
    k = opt.memory_stats()["disk_steps"]
    train(opt, params, range(k, k + 3))
    assert digest(params, opt) == ref.at(k + 3)
