"""`python -m hipferry doctor`: what a bug report needs, and whether this build works here.

Exit code 0 when this build works on this machine; 1 with the reasons when it cannot.
"""
import copy
import os
import platform as py_platform
import sys
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple, Type

import torch

from . import platform as hf_platform
from . import pool
from .bench import best_of_interleaved, gpu_timer, wall_timer
from .ops import copy_cast_

MiB = 1 << 20


def diagnose(build_target: str, torch_flavor: str, runtime_devices: int, torch_devices: int) -> List[str]:
    """Problems that stop this build from working here (empty list: it works)."""
    problems = []
    if build_target in ("rocm", "cuda") and torch_flavor != build_target:
        problems.append(
            f"hipferry was built for {build_target} but is running under a {torch_flavor} build of torch "
            f"{torch.__version__}; reinstall hipferry in this environment "
            f"(pip install --no-build-isolation --force-reinstall .) or switch torch back")
    if build_target in ("rocm", "cuda") and torch_flavor == build_target and runtime_devices != torch_devices:
        problems.append(
            f"the {build_target} runtime sees {runtime_devices} device(s) but torch sees {torch_devices}; "
            "check HIP_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES and that both use the same driver")
    return problems


def notes(build_target: str, torch_flavor: str, runtime_devices: int) -> List[str]:
    """Things worth knowing that do not stop the build from working."""
    out = []
    if build_target == "cpu" and torch_flavor != "cpu":
        out.append(f"this is a CPU-only build under a {torch_flavor} torch: GPU tensors are not accepted; "
                   "rebuild with HIPFERRY_TARGET=auto to use the GPU")
    if build_target in ("rocm", "cuda") and runtime_devices == 0:
        out.append("no GPU device visible: everything runs on the CPU")
    return out


def measure_cpu_bandwidth(nbytes: int = 256 * MiB, repeats: int = 5) -> Dict[str, float]:
    """GB/s of host memory copy (torch copy_) and of hipferry's float32->bfloat16 pass,
    counting bytes read plus bytes written."""
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    dst16 = torch.empty(src.shape, dtype=torch.bfloat16)
    best = best_of_interleaved({"copy": wall_timer(lambda: dst.copy_(src)),
                                "cast": wall_timer(lambda: copy_cast_(dst16, src))}, repeats)
    copy_s, cast_s = best["copy"], best["cast"]
    return {"host_copy_GBps": 2 * nbytes / copy_s / 1e9,
            "copy_cast_f32_to_bf16_GBps": 1.5 * nbytes / cast_s / 1e9}


def measure_gpu_bandwidth(device: int, nbytes: int = 64 * MiB, repeats: int = 5) -> Dict[str, float]:
    """GB/s host->device and device->host, pageable and pinned (torch copies)."""
    dev = torch.device("cuda", device)
    with torch.cuda.device(dev):
        d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        out = {}
        for kind in ("pageable", "pinned"):
            h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=(kind == "pinned"))
            best = best_of_interleaved({"h2d": gpu_timer(lambda: d.copy_(h, non_blocking=True)),
                                        "d2h": gpu_timer(lambda: h.copy_(d, non_blocking=True))}, repeats)
            out[f"h2d_{kind}_GBps"] = nbytes / best["h2d"] / 1e9
            out[f"d2h_{kind}_GBps"] = nbytes / best["d2h"] / 1e9
        return out


def _default_pool_placement(native) -> str:
    """Where the default pool's pages come from, from its configuration (the
    pool is not made)."""
    try:
        default, devices = pool.numa_placement(pool.default_pool_config().get("numa_node", "auto"))
    except (TypeError, ValueError) as e:
        return f"the default pool's numa_node is invalid: {e}"
    placed = [f"GPU {d} -> node {n}" for d, n in enumerate(devices) if n >= 0]
    if placed:
        return ("the default pool gives each GPU pages from its node (" + ", ".join(placed) +
                f"), host-only memory {'from node ' + str(default) if default >= 0 else 'unbound'}")
    if default >= 0:
        return f"the default pool's pages come from node {default}"
    return "the default pool binds no node: its pages land where first touched"


def describe_pool(gpu: bool, nbytes: int = 64 * MiB) -> str:
    """Which memory the default pool configuration gets, and how long a cold allocation takes."""
    with pool.PinnedPool(**pool.default_pool_config()) as p:
        t0 = time.perf_counter()
        t = p.empty(nbytes, dtype=torch.uint8)
        ms = (time.perf_counter() - t0) * 1e3
        pinned = t.is_pinned() if gpu else False
        del t
        return (f"{p.provider}, {nbytes // MiB} MiB cold in {ms:.1f} ms, "
                f"{'page-locked' if pinned else 'not page-locked (no GPU)' if not gpu else 'NOT page-locked'}; "
                f"${pool.ENV_VAR}={os.environ.get(pool.ENV_VAR) or '(unset)'}")


def self_test(device: str) -> None:
    """copy_cast_ on `device` must agree bit for bit with torch's .to()."""
    src = torch.randn(100_003, dtype=torch.float32) * 1e3
    if device != "cpu":
        src = src.pin_memory()
    for dtype in (torch.bfloat16, torch.float16):
        dst = torch.empty(src.shape, dtype=dtype, device=device)
        copy_cast_(dst, src)
        if device != "cpu":
            torch.cuda.synchronize()
        want = src.to(dtype).to(device)
        if not torch.equal(dst.view(torch.int16), want.view(torch.int16)):
            raise RuntimeError(f"copy_cast_ float32->{dtype} on {device} differs from torch .to()")


def transfer_self_test(device: str) -> str:
    """prefetch (pinned and pageable, small and large, with and without
    conversion) and offload round trips on `device`, checked bit for bit."""
    from .pool import pin
    from .transfer import offload, prefetch, transfer_stats
    big = torch.randn(3_000_000) * 1e3
    small = [torch.randn(1000 + i) for i in range(8)]
    cases = {"pinned": [pin(big)] + [pin(t) for t in small], "pageable": [big] + small}
    for kind, srcs in cases.items():
        for dtype in (None, torch.bfloat16):
            got = prefetch(srcs, device, dtype=dtype).wait()
            back = offload(got).wait()
            for s, b in zip(srcs, back):
                want = s if dtype is None else s.to(dtype)
                if not torch.equal(b.view(torch.int16), want.view(torch.int16)):
                    raise RuntimeError(f"prefetch/offload of {kind} tensors (dtype={dtype}) to {device} "
                                       "came back different")
    if device == "cpu":
        return "prefetch/offload round trips exact on cpu (worker thread)"
    stats = transfer_stats()
    return (f"prefetch/offload round trips exact on {device} ({stats['packed_tensors']} tensors packed, "
            f"{stats['staged_chunks']} chunks staged so far)")


def optimizer_self_test(device: str) -> str:
    """Three OffloadAdamW steps with each engine `device` has (float32 and
    bfloat16 parameters; one large enough to be offloaded, one kept on the
    device) against the fused step on the CPU, bit for bit: the kernel and the
    CPU loop run the same element-wise function."""
    from . import _C
    from .optim import OffloadAdamW
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    engines = ["cpu", "gpu"] if device != "cpu" else ["cpu"]
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(5000, generator=gen), torch.randn(300, generator=gen)]
    grads = [[torch.randn(v.shape, generator=gen) for v in values] for _ in range(3)]
    for dtype in (torch.float32, torch.bfloat16):
        # The reference: the state as float32 on the CPU, the fused step by hand.
        master = [v.to(dtype).float() for v in values]
        m, v2 = [torch.zeros_like(x) for x in master], [torch.zeros_like(x) for x in master]
        out = [x.to(dtype) for x in master]
        for step, gs in enumerate(grads, 1):
            for i, g in enumerate(gs):
                _C._adamw_step_(master[i], g.to(dtype), m[i], v2[i], None, out[i] if dtype != torch.float32 else None,
                                step, hyper["lr"], 0.9, 0.99, 1e-8, 0.1, False, False)
        want = out if dtype != torch.float32 else master
        for engine in engines:
            params = [torch.nn.Parameter(x.to(device=device, dtype=dtype)) for x in values]
            opt = OffloadAdamW(params, step_on=engine, min_offload_numel=1000, **hyper)
            for gs in grads:
                for p, g in zip(params, gs):
                    p.grad = g.to(device=device, dtype=dtype)
                opt.step()
            for p, w in zip(params, want):
                if not torch.equal(p.detach().cpu().view(torch.int16), w.view(torch.int16)):
                    raise RuntimeError(f"OffloadAdamW(step_on={engine!r}) on {device} in {dtype} differs from the "
                                       "CPU reference step")
    return f"OffloadAdamW steps bit-identical to the CPU reference (engines: {', '.join(engines)}; {device})"


def disk_self_test(folder: Optional[str] = None) -> str:
    """OffloadAdamW(state_dir=...) in a temporary folder (under `folder`, default
    HIPFERRY_STATE_DIR or the system's temp folder): three steps against the
    optimizer with its state in memory, bit for bit; which I/O path runs, and why."""
    import tempfile
    from .optim import DiskOptions, OffloadAdamW
    base = folder or os.environ.get("HIPFERRY_STATE_DIR") or tempfile.gettempdir()
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(300_000, generator=gen), torch.randn(1000, generator=gen).bfloat16()]
    with tempfile.TemporaryDirectory(dir=base, prefix="hipferry-doctor-") as d:
        params = [torch.nn.Parameter(v.clone()) for v in values]
        twins = [torch.nn.Parameter(v.clone()) for v in values]
        opt = OffloadAdamW(params, state_dir=d, disk=DiskOptions(chunk_numel=1 << 18, window_bytes=16 << 20))
        ref = OffloadAdamW(twins)
        for step in range(3):
            for ps, o in ((params, opt), (twins, ref)):
                for p in ps:
                    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).to(p.dtype)
                o.step()
        stats = opt.memory_stats()
        del opt
        for p, q in zip(params, twins):
            if not torch.equal(p.detach(), q.detach()):
                raise RuntimeError(f"OffloadAdamW(state_dir=...) in {base} differs from the in-memory optimizer")
    note = stats["io_backend_note"]
    io = stats["io_backend"] + (f" ({note})" if note and note != stats["io_backend"] else "")
    direct = "O_DIRECT" if stats["direct_io"] else f"buffered ({stats['direct_io_note']})"
    return f"state on disk in {base}: {io}, {direct}; steps bit-identical to the in-memory optimizer"


def module_offload_self_test(device: str) -> str:
    """A 4-block MLP with offload_layers (prefetch 1) and offload_activations
    against the same model without them on `device`: the outputs and every
    gradient bit for bit, in a no-grad pass and a training step."""
    from .module_offload import offload_activations, offload_layers
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
              for _ in range(4)]
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Sequential(*blocks), torch.nn.Linear(64, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    reference = copy.deepcopy(model).to(device)
    x = torch.randn(32, 16, generator=gen).to(device)
    handle = offload_layers(model, prefetch=1, layers=list(blocks), device=device)
    try:
        with torch.no_grad():
            if not torch.equal(model(x), reference(x)):
                raise RuntimeError(f"offload_layers on {device}: no-grad output differs from the model without it")
        with offload_activations(min_bytes=4096):
            loss = model(x).square().sum()
        loss.backward()
        reference(x).square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if p.grad is None or not torch.equal(p.grad.to(q.device), q.grad):
                raise RuntimeError(f"offload_layers + offload_activations on {device}: gradient of {name} differs")
        s = handle.stats()
    finally:
        handle.undo()
    return (f"offload_layers + offload_activations outputs and gradients bit-identical ({device}; "
            f"{s['hits']} prefetch hits, {s['stalls']} stalls)")


class Check(NamedTuple):
    """One self-check of `run`: a report line under `label`, computed by
    `line`; an error of the types in `raises` means the build does not work
    here (reported as "<problem> failed: <error>"), any other is a bug in
    the doctor and propagates."""
    label: str
    line: Callable[[], str]
    problem: str
    raises: Tuple[Type[BaseException], ...] = (RuntimeError,)


def _copy_cast_self_test(gpu: bool) -> str:
    self_test("cpu")
    if gpu:
        self_test("cuda")
    return "copy_cast_ matches torch .to() bit for bit"


def self_checks(runtime_devices: int, torch_devices: int) -> List[Check]:
    """The self-checks, in the order the report shows them."""
    device = "cuda" if runtime_devices > 0 and torch_devices > 0 else "cpu"
    return [
        Check("self-test", lambda: _copy_cast_self_test(runtime_devices > 0), "self-test"),
        Check("transfers", lambda: transfer_self_test(device), "transfer self-test"),
        Check("optimizer", lambda: optimizer_self_test(device), "optimizer self-test"),
        Check("module offload", lambda: module_offload_self_test(device), "module offload self-test"),
        Check("disk state", disk_self_test, "disk state self-test", (RuntimeError, OSError, ValueError)),
        Check("pinned pool", lambda: describe_pool(device == "cuda"), "pinned pool"),
    ]


def run_checks(checks: List[Check], write: Callable[[str], object]) -> List[str]:
    """Writes each check's line; returns the problems of those that failed."""
    problems = []
    for check in checks:
        try:
            write(f"  {check.label:<16}{check.line()}\n")
        except check.raises as e:
            problems.append(f"{check.problem} failed: {e}")
    return problems


def _write_header(w: Callable[[str], object], build: dict, flavor: str, torch_devices: int) -> None:
    """The versions and the machine: what a bug report needs."""
    w("hipferry doctor\n")
    w(f"  hipferry        {sys.modules['hipferry'].__version__}, built for {build['target']}"
      f" ({build['architectures'] or 'no GPU architectures'}) against torch {build['torch_version_built_against']}\n")
    w(f"  torch range     {build['torch_supported']}; ABI: {build['torch_abi']}\n")
    w(f"  runtime         version {build['runtime_version']}, driver {build['driver_version']}\n")
    w(f"  torch           {torch.__version__} ({flavor}"
      f"{' ' + (torch.version.hip or torch.version.cuda) if flavor != 'cpu' else ''}), "
      f"{torch_devices} device(s) visible to torch\n")
    w(f"  python          {py_platform.python_version()} on {py_platform.platform()}\n")
    w(f"  cpu             {py_platform.processor() or py_platform.machine()}, {torch.get_num_threads()} threads, "
      f"F16C path: {'yes' if build['cpu_f16c'] else 'no'}\n")

    from . import _C as _native
    nodes = _native.numa_nodes()
    w(f"  numa            {len(nodes)} node(s): {', '.join(map(str, nodes))}"
      f"{'' if len(nodes) > 1 else ' (no placement to choose)'}; {_default_pool_placement(_native)}\n")


def _check_devices(w: Callable[[str], object], runtime_devices: int) -> List[str]:
    """Writes each device and whether host memory maps into GPU 0; returns the problems."""
    problems = []
    for i in range(runtime_devices):
        info = hf_platform.device_info(i)
        w(f"  device {i}        {info['name']} ({info['arch']}), {info['total_memory'] / 2**30:.1f} GiB, "
          f"{info['multiprocessors']} multiprocessors, maps host memory: {info['can_map_host_memory']}, "
          f"PCI {info['pci_bus_id']}, NUMA node "
          f"{info['numa_node'] if info['numa_node'] >= 0 else 'unknown'}\n")
    if runtime_devices > 0:
        from . import _C
        for label, flags, reg in (("pinned (hipHostMalloc, mapped)", 0x2 | 0x1, False),
                                  ("registered (hipHostRegister, mapped)", 0x2 | 0x1, True)):
            try:
                r = _C.check_host_memory(0, 4 * MiB, flags, reg)
                ok = r["round_trip_ok"]
                w(f"  host memory     {label}: {'works' if ok else 'DATA MISMATCH'}"
                  + ("" if r["device_address_equals_host_address"]
                     else " (device address differs from host address)") + "\n")
                if not ok:
                    problems.append(f"{label} host memory round trip gave wrong data")
            except RuntimeError as e:
                problems.append(f"{label} host memory failed: {e}")
    return problems


def run(quick: bool = False) -> int:
    build = hf_platform.build_info()
    flavor = hf_platform.torch_flavor()
    runtime_devices = hf_platform.device_count()
    torch_devices = torch.cuda.device_count() if flavor != "cpu" else 0
    w = sys.stdout.write
    _write_header(w, build, flavor, torch_devices)

    problems = diagnose(build["target"], flavor, runtime_devices, torch_devices)
    for n in notes(build["target"], flavor, runtime_devices):
        w(f"  note            {n}\n")

    if not problems:
        problems += _check_devices(w, runtime_devices)
        problems += run_checks(self_checks(runtime_devices, torch_devices), w)
        w("  bandwidth       measuring...\n")
        cpu = measure_cpu_bandwidth(64 * MiB if quick else 256 * MiB, 3 if quick else 5)
        w(f"  host memory     copy {cpu['host_copy_GBps']:.1f} GB/s, copy_cast f32->bf16 "
          f"{cpu['copy_cast_f32_to_bf16_GBps']:.1f} GB/s (bytes read + written)\n")
        for i in range(runtime_devices if torch_devices else 0):
            g = measure_gpu_bandwidth(i, 16 * MiB if quick else 64 * MiB)
            w(f"  device {i} link   H2D pageable {g['h2d_pageable_GBps']:.1f}, pinned {g['h2d_pinned_GBps']:.1f} GB/s; "
              f"D2H pageable {g['d2h_pageable_GBps']:.1f}, pinned {g['d2h_pinned_GBps']:.1f} GB/s\n")

    if problems:
        for p in problems:
            w(f"  PROBLEM         {p}\n")
        w("status: NOT WORKING\n")
        return 1
    w("status: OK\n")
    return 0
