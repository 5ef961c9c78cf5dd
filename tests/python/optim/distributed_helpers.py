"""Shared pieces of the distributed OffloadAdamW tests (test_offload_adamw_distributed.py):
a free port, spawning ranks with a deadline (a hang fails instead of blocking CI), the
model, the data and ONE training loop used by every rank and by the single-process
reference, and the per-rank workers (module level, so the spawn start method can pickle
them by name). Workers write their results with torch.save into a directory given by the
test; the test compares them in the parent process."""
import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
STEPS = 10
GLOBAL_BATCH = 16  # each rank gets GLOBAL_BATCH // WORLD_SIZE rows
IN_FEATURES, HIDDEN, OUT_FEATURES = 12, 24, 5  # 5 rows: FSDP2 shards them unevenly (3 + 2)
LR, WEIGHT_DECAY, MAX_NORM = 2e-2, 0.1, 0.5
SPAWN_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_then_exit(rank, fn, *args):
    """fn(rank, *args), then the process ends without interpreter finalization. About 1 run in
    10 of a gloo worker aborts there ("terminate called without an active exception", after
    destroy_process_group, with torch.optim.AdamW as much as with hipferry; torch 2.14 and
    2.15): gloo's threads outlive the interpreter (pytorch/pytorch#179291 discusses it). An
    exception in fn still fails the rank the ordinary way."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, *args, nprocs=WORLD_SIZE, timeout=SPAWN_TIMEOUT_S):
    """Runs fn(rank, *args) in nprocs fresh processes; raises if one fails, kills all
    and raises TimeoutError if they are not done within `timeout` seconds."""
    ctx = mp.start_processes(_run_then_exit, args=(fn, *args), nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):  # raises if a rank failed
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
            raise TimeoutError(f"{fn.__name__}: ranks still running after {timeout} s (a hang?)")


def init_gloo(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=60))


def make_mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, OUT_FEATURES))


def make_batches(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=g), torch.randn(GLOBAL_BATCH, OUT_FEATURES, generator=g))
            for _ in range(STEPS)]


def param_groups(model):
    """Two groups, as real training sets them up: no weight decay on biases."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not n.endswith("bias")]},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


def make_optimizer(model, kind="offload"):
    """kind="torch" builds torch.optim.AdamW, to check the harness itself."""
    if kind == "torch":
        return torch.optim.AdamW(param_groups(model), lr=LR, weight_decay=WEIGHT_DECAY)
    import hipferry.optim
    return hipferry.optim.OffloadAdamW(param_groups(model), lr=LR, weight_decay=WEIGHT_DECAY, step_on="cpu")


def train(model, opt, batches, clip="optimizer"):
    """STEPS steps of mean-squared error with a warmup+cosine schedule and gradient clipping
    (clip="optimizer": opt.clip_grad_norm_, "torch": torch.nn.utils.clip_grad_norm_).
    Returns the total gradient norms before clipping and the learning rates used."""
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - 3)], milestones=[3])
    norms, lrs = [], []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip == "optimizer" and hasattr(opt, "clip_grad_norm_"):
            norm = opt.clip_grad_norm_(MAX_NORM)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        norms.append(float(norm))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return norms, lrs


def rank_rows(batches, rank):
    rows = GLOBAL_BATCH // WORLD_SIZE
    return [(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]) for x, y in batches]


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


# --- workers ----------------------------------------------------------------------------

def ddp_worker(rank, port, out_dir, kind="offload"):
    init_gloo(rank, port)
    try:
        model = make_mlp()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = make_optimizer(model, kind)
        norms, lrs = train(ddp, opt, rank_rows(make_batches(), rank), clip="optimizer")
        torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "norms": norms, "lrs": lrs}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def ddp_overlap_worker(rank, port, out_dir, remote=False):
    """The same DDP training twice on each rank: OffloadAdamW without overlap, and with
    overlap="backward" and its DDP comm hook (issue 26). Saves both runs' parameters and
    state and the overlap counters. remote=True: CPU parameters through the GPU
    parameters' path (offload_adamw_helpers.CpuRemoteOffloadAdamW, issue 31)."""
    import hipferry.optim
    from offload_adamw_helpers import CpuRemoteOffloadAdamW
    init_gloo(rank, port)
    try:
        runs = {}
        cls = CpuRemoteOffloadAdamW if remote else hipferry.optim.OffloadAdamW
        for overlap in (None, "backward"):
            model = make_mlp()
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            opt = cls(param_groups(model), lr=LR, weight_decay=WEIGHT_DECAY, step_on="cpu", overlap=overlap)
            if overlap is not None:
                opt.register_ddp_comm_hook(ddp)
            norms, _ = train(ddp, opt, rank_rows(make_batches(), rank), clip="optimizer")
            runs[str(overlap)] = {
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "state": {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()},
                "norms": norms, "stats": opt.overlap_stats(),
                "grad_copies": (opt.grad_copies_reused, opt.grad_copies_made_at_step)}
        torch.save(runs, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def fsdp2_overlap_worker(rank, port, out_dir):
    """The same FSDP2 training twice on each rank: OffloadAdamW without overlap and with
    overlap="backward" (issue 26). Saves both runs' local shards, state and counters."""
    import hipferry.optim
    init_gloo(rank, port)
    try:
        fully_shard = import_fully_shard()
        runs = {}
        for overlap in (None, "backward"):
            model = make_mlp()
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
            opt = hipferry.optim.OffloadAdamW(param_groups(model), lr=LR, weight_decay=WEIGHT_DECAY, step_on="cpu",
                                              overlap=overlap)
            norms, _ = train(model, opt, rank_rows(make_batches(), rank), clip="torch")
            runs[str(overlap)] = {
                "params": {n: local(p).detach().clone() for n, p in model.named_parameters()},
                "state": {n: {k: local(v).clone() for k, v in opt.state[p].items()}
                          for n, p in model.named_parameters()},
                "norms": norms, "stats": opt.overlap_stats()}
        torch.save(runs, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def import_fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def fsdp2_worker(rank, port, out_dir, kind="offload"):
    init_gloo(rank, port)
    try:
        fully_shard = import_fully_shard()
        model = make_mlp()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = make_optimizer(model, kind)
        norms, lrs = train(model, opt, rank_rows(make_batches(), rank), clip="torch")
        names = {p: n for n, p in model.named_parameters()}
        shards = {}
        for n, p in model.named_parameters():
            exp_avg = opt.state[p]["exp_avg"]
            shards[n] = {"param_numel": p.numel(), "param_local_numel": local(p).numel(),
                         "param_is_dtensor": hasattr(p, "to_local"),
                         "exp_avg_type": type(exp_avg).__name__, "exp_avg_local_numel": local(exp_avg).numel(),
                         "exp_avg_local_shape": tuple(local(exp_avg).shape),
                         "param_local_shape": tuple(local(p).shape),
                         "step": float(opt.state[p]["step"])}
        # state_dict() under FSDP2: each entry as saved (its type, its local part), whether it
        # loads back, and whether torch.optim.AdamW takes it and steps on with it.
        sd = opt.state_dict()
        order = [names[p] for g in opt.param_groups for p in g["params"]]
        sd_summary = {"groups": [{k: v for k, v in g.items() if k != "params"} | {"params": list(g["params"])}
                                 for g in sd["param_groups"]],
                      "state_keys": sorted(sd["state"]),
                      "state": {order[i]: {k: (float(v) if k == "step" else
                                               {"type": type(v).__name__, "shape": tuple(v.shape),
                                                "local": local(v).detach().clone()} if torch.is_tensor(v) else v)
                                           for k, v in s.items()} for i, s in sd["state"].items()}}
        opt.load_state_dict(sd)  # loads back into the same optimizer
        after_load = {names[p]: local(opt.state[p]["exp_avg"]).detach().clone() for p in names}
        params = {n: full(p).detach().clone() for n, p in model.named_parameters()}
        try:
            into_torch = torch.optim.AdamW(param_groups(model), lr=LR, weight_decay=WEIGHT_DECAY)
            into_torch.load_state_dict(sd)
            x, y = rank_rows(make_batches(seed=2), rank)[0]
            torch.nn.functional.mse_loss(model(x), y).backward()
            into_torch.step()
            torch_error = None
        except Exception as e:  # reported by the test
            torch_error = f"{type(e).__name__}: {e}"
        torch.save({"params": params, "norms": norms, "lrs": lrs, "shards": shards, "state_dict": sd_summary,
                    "exp_avg_after_load": after_load, "load_into_torch_adamw_error": torch_error},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
