"""Fine-tune a small GPT-style model with hipferry.optim.OffloadAdamW, side by side with torch.optim.AdamW.

OffloadAdamW keeps the optimizer state (exp_avg, exp_avg_sq and, for a
bfloat16 model, a float32 master copy of the weights) in pinned host memory
from hipferry's pool instead of device memory. The same training runs twice,
from the same initial weights on the same batches, with a warm-up + cosine
LambdaLR schedule and gradient clipping to 1.0: once with OffloadAdamW, once
with torch.optim.AdamW. The model is defined here with random weights and
learns the paragraph bundled below, byte by byte: nothing is downloaded.
On the CPU the default run takes about a minute; on a GPU the default model
is larger and runs in bfloat16.

    python examples/finetune.py [--steps 40] [--layers 4] [--width 384] [--heads 6] [--seq 128]
                                [--batch 8] [--device auto|cpu|cuda] [--dtype float32|bfloat16]
                                [--step-on auto|cpu|gpu] [--parity-8bit] [--state-dir DIR] [--json PATH]
                                [--plot PATH]

--parity-8bit adds a third run, OffloadAdamW(state_dtype=torch.uint8) (m and v
in 8 bits, blockwise, about 2 bytes per parameter instead of 8), and reports
its loss curve against the float32-state run: the largest relative gap over
all steps must be at most 1%.

--state-dir DIR keeps OffloadAdamW's state in files under DIR (an empty folder;
docs/disk-state.md): the same exact AdamW, with the host holding only a window of
chunks in flight, so a state larger than RAM trains.

Exit code 0 when the loss went down (and, in float32, the two runs' losses
agree within 1e-3 relative at every step; with --parity-8bit, the 8-bit run
within 1%), 1 when a check fails, 2 on a bad argument.
"""
import argparse
import copy
import ctypes
import gc
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import hipferry
from hipferry.optim import OffloadAdamW, calibrate

TEXT = b"""\
The ferry leaves the east bank at first light, when the river is still grey and the gulls are asleep on the pilings.
It carries whatever the morning brings: a baker with two crates of bread, a schoolteacher who reads on the crossing,
a farmer with a goat that will not stand still, and now and then a truck so heavy that the deck sinks a hand's width
lower in the water. The pilot has made the crossing so many times that she no longer looks at the far shore. She
watches the current instead, the way it folds around the sandbar in spring and slides past it in autumn, and she
steers a little upstream of where she means to land, so that the river itself brings her home. Nobody on board
thinks much about the crossing. They think about the day ahead, the bread that must be sold, the lesson that must be
taught, the goat that must be sold or kept. That is how it should be. A good ferry is one you forget while you are
on it. The engine hums below the deck, the cables creak, the wake spreads out behind in a long slow fan, and ten
minutes later the ramp comes down on the west bank with a soft thump. In the evening the same people cross back in
the other direction, tired, with empty crates and full pockets, or the other way round. The pilot counts them
without meaning to. On a good day the numbers match. On a bad day someone has stayed behind, and she waits five
minutes longer than the timetable says, because the last ferry is the one that matters most. When the river freezes,
which happens once in ten winters, the ferry stays tied to the east bank and the town discovers how far away the
other side really is.
"""

DEFAULTS = {"cpu": dict(layers=4, width=384, heads=6, seq=128, batch=8, steps=40),  # 7 M parameters, ~1 min
            "cuda": dict(layers=12, width=768, heads=12, seq=512, batch=16, steps=60)}  # 86 M parameters


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, help_ in (("layers", "transformer blocks"), ("width", "model width"), ("heads", "attention heads"),
                        ("seq", "tokens (bytes) per sequence"), ("batch", "sequences per step"),
                        ("steps", "optimizer steps per run")):
        p.add_argument(f"--{name}", type=int, help=f"{help_} (default: CPU {DEFAULTS['cpu'][name]}, "
                                                   f"GPU {DEFAULTS['cuda'][name]})")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary (>= 256: byte-level tokens)")
    p.add_argument("--untied-head", action="store_true", help="an LM head of its own (default: tied to the embedding)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: float32 on the CPU, bfloat16 on a GPU")
    p.add_argument("--step-on", choices=["auto", "cpu", "gpu"], default="auto", help="OffloadAdamW's engine")
    p.add_argument("--parity-8bit", action="store_true",
                   help="also train with 8-bit optimizer state and report the loss gap to float32 state")
    p.add_argument("--state-dir", metavar="DIR", help="OffloadAdamW's state in files under DIR (an empty folder)")
    p.add_argument("--log-every", type=int, help="progress line every N steps (default: steps/10)")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    p.add_argument("--plot", metavar="PATH", help="write both loss curves as a PNG (needs matplotlib)")
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() and hipferry.device_count() > 0 else "cpu"
    if a.device == "cuda" and not (torch.cuda.is_available() and hipferry.device_count() > 0):
        p.error("--device cuda: no GPU visible to torch and hipferry")
    for k, v in DEFAULTS[a.device].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.dtype = a.dtype or ("float32" if a.device == "cpu" else "bfloat16")
    problems = [(min(a.layers, a.width, a.heads, a.batch) < 1, "--layers, --width, --heads and --batch must be >= 1"),
                (a.width % a.heads, f"--width ({a.width}) must be a multiple of --heads ({a.heads})"),
                (not 2 <= a.seq < len(TEXT), f"--seq must be in [2, {len(TEXT) - 1}] (the bundled text's length)"),
                (a.steps < 4, f"--steps must be >= 4, got {a.steps}"),
                ((a.log_every or 1) < 1, f"--log-every must be >= 1, got {a.log_every}"),
                (a.vocab < 256, f"--vocab must be >= 256 (byte-level tokens), got {a.vocab}"),
                (not a.lr > 0, f"--lr must be > 0, got {a.lr}"),
                (a.step_on == "gpu" and a.device != "cuda", "--step-on gpu needs --device cuda (GPU parameters)")]
    for bad, message in problems:
        if bad:
            p.error(message)
    a.log_every = a.log_every or max(1, a.steps // 10)
    return a


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention and a 4x MLP, each with a residual."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok, self.pos = nn.Embedding(a.vocab, a.width), nn.Embedding(a.seq, a.width)
        self.blocks = nn.ModuleList(Block(a.width, a.heads) for _ in range(a.layers))
        self.ln = nn.LayerNorm(a.width)
        self.head = nn.Linear(a.width, a.vocab, bias=False)
        if not a.untied_head:
            self.head.weight = self.tok.weight  # one parameter, stepped once
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make_batches(a):
    """Random windows of the bundled text (fixed seed): inputs and next-byte targets, the same for both runs."""
    data = torch.frombuffer(bytearray(TEXT), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, len(data) - a.seq, (a.steps, a.batch), generator=g)
    windows = [torch.stack([data[s:s + a.seq + 1] for s in row.tolist()]) for row in starts]
    return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]


def lr_lambda(steps):
    warmup = max(1, steps // 10)
    return lambda i: (i + 1) / warmup if i < warmup else \
        0.1 + 0.45 * (1 + math.cos(math.pi * (i - warmup) / max(1, steps - warmup)))


def rss_bytes():
    """The process's resident memory now, after handing freed heap memory back to the system (glibc)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def state_bytes(opt):
    """(host, device) bytes of a torch optimizer's state tensors."""
    host = dev = 0
    for s in opt.state.values():
        for k, t in s.items():
            if torch.is_tensor(t) and k != "step":  # as OffloadAdamW.memory_stats() counts
                n = t.numel() * t.element_size()
                host, dev = (host + n, dev) if t.device.type == "cpu" else (host, dev + n)
    return host, dev


def warm_up(base, batches, a):
    """One untimed step, thrown away: loads torch's lazy modules, grows the allocators and picks kernels, so
    that neither run pays for it. On a GPU, OffloadAdamW's calibration (for step_on="auto") runs here too."""
    model = copy.deepcopy(base).to(a.device, getattr(torch, a.dtype))
    x, y = batches[0]
    F.cross_entropy(model(x.to(a.device)).float().flatten(0, 1), y.to(a.device).flatten()).backward()
    torch.optim.AdamW(model.parameters()).step()
    if a.device == "cuda" and a.step_on == "auto":
        calibrate()  # link bandwidth and CPU AdamW throughput, measured once and cached in ~/.cache/hipferry


def train(name, base, batches, a, use_hipferry, state_dtype=torch.float32):
    cuda = a.device == "cuda"
    gc.collect()  # the previous run's model and optimizer are gone ...
    hipferry.default_pool().trim()  # ... and so is the pinned memory the pool cached for it
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    rss0 = rss_bytes()
    model = copy.deepcopy(base).to(a.device, getattr(torch, a.dtype))
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},  # matrices and embeddings
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # biases and LayerNorms
    adamw = OffloadAdamW if use_hipferry else torch.optim.AdamW
    extra = {"step_on": a.step_on if state_dtype == torch.float32 else "cpu", "state_dtype": state_dtype}
    if a.state_dir:  # one folder per run: a folder holds one optimizer's state
        extra["state_dir"] = f"{a.state_dir}/{name.replace(' ', '-')}"
        if a.device == "cuda":
            extra["step_on"] = "cpu"  # (the GPU-streamed engine moves host state only)
    opt = adamw(groups, lr=a.lr, betas=(0.9, 0.95), **(extra if use_hipferry else {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(a.steps))
    r = {"losses": [], "lrs": [], "step_ms": []}
    for i, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        x, y = x.to(a.device, non_blocking=True), y.to(a.device, non_blocking=True)
        logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        if use_hipferry:  # same result as torch's, and the CPU engine's in-flight gradient copies stay usable
            opt.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        r["lrs"].append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        r["losses"].append(loss.item())
        if cuda:
            torch.cuda.synchronize()
        r["step_ms"].append((time.perf_counter() - t0) * 1e3)
        if (i + 1) % a.log_every == 0 or i + 1 == a.steps:
            print(f"[{name}] step {i + 1:>4}/{a.steps}  loss {r['losses'][-1]:.4f}  lr {r['lrs'][-1]:.2e}  "
                  f"{r['step_ms'][-1]:8.1f} ms/step", flush=True)
    warm = min(3, a.steps // 4)  # the first steps allocate state, pick kernels, fill caches
    r["median_step_ms"] = statistics.median(r["step_ms"][warm:])
    r["device_peak_bytes"] = torch.cuda.max_memory_allocated() if cuda else None
    if use_hipferry:
        opt.synchronize()
        r.update(opt.memory_stats())
        r["step_on"], r["step_on_reason"] = opt.step_on, opt.step_on_reason
    else:
        r["host_state_bytes"], r["device_state_bytes"] = state_bytes(opt)
    r["rss_bytes"] = rss_bytes()
    r["rss_growth_bytes"] = r["rss_bytes"] - rss0
    return r


def write_plot(path, runs, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = {"hipferry": "hipferry OffloadAdamW", "torch": "torch.optim.AdamW",
              "hipferry_8bit": "OffloadAdamW, 8-bit state"}
    styles = {"hipferry": "-", "torch": "--", "hipferry_8bit": ":"}
    for name, r in runs.items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=labels[name], linestyle=styles[name])
    ax.set(xlabel="step", ylabel="training loss", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"loss curves: {path}")


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.manual_seed(0)
    base = GPT(a)  # the initial weights of both runs
    n_params = sum(p.numel() for p in base.parameters())
    print(f"hipferry {hipferry.__version__} ({hipferry.build_info()['target']} build) on {a.device}, {a.dtype}; "
          f"GPT: {a.layers} blocks, width {a.width}, {a.heads} heads, vocab {a.vocab}, "
          f"{'untied' if a.untied_head else 'tied'} head: {n_params / 1e6:.2f} M parameters")
    print(f"data: {a.steps} steps x {a.batch} windows of {a.seq} bytes from a {len(TEXT)}-byte bundled text; "
          f"AdamW lr {a.lr:g} (warm-up + cosine), weight decay 0.1, clip 1.0")
    if a.dtype == "bfloat16":
        print("bfloat16: OffloadAdamW keeps a float32 master copy on the host; the baseline is torch.optim.AdamW "
              "stepping the bfloat16 weights directly, so the loss curves differ by design")
    batches = make_batches(a)
    warm_up(base, batches, a)
    runs = {"hipferry": train("OffloadAdamW", base, batches, a, use_hipferry=True),
            "torch": train("torch AdamW", base, batches, a, use_hipferry=False)}
    h, t = runs["hipferry"], runs["torch"]
    if a.parity_8bit:
        runs["hipferry_8bit"] = train("OffloadAdamW 8-bit", base, batches, a, use_hipferry=True,
                                      state_dtype=torch.uint8)

    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    dev = lambda r: mib(r["device_peak_bytes"]) if r["device_peak_bytes"] is not None else "n/a (CPU)"  # noqa: E731
    rows = [("step time (median)", lambda r: f"{r['median_step_ms']:.1f} ms"),
            ("first -> final loss", lambda r: f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"),
            ("device memory (peak)", dev),
            ("optimizer state on host", lambda r: mib(r["host_state_bytes"])),
            ("optimizer state on device", lambda r: mib(r["device_state_bytes"])),
            ("process RSS at end (growth)",
             lambda r: f"{mib(r['rss_bytes'])} ({r['rss_growth_bytes'] / 2**20:+.1f} MiB)")]
    print(f"\n{'':<28}{'hipferry OffloadAdamW':>26}{'torch.optim.AdamW':>26}")
    for label, cell in rows:
        print(f"{label:<28}{cell(h):>26}{cell(t):>26}")
    if "disk_state_bytes" in h:
        print(f"optimizer state on disk: {mib(h['disk_state_bytes'])} (two slots) under {a.state_dir}; "
              f"{mib(h['disk_bytes_read_per_step'])} read and {mib(h['disk_bytes_written_per_step'])} written a "
              f"step through {h['io_backend']}; the host holds a window of {mib(h['disk_window_bytes'])}")
    if h.get("ring_bytes") or h.get("grad_buffer_bytes"):
        print(f"OffloadAdamW also holds: a device ring of {mib(h['ring_bytes'])} (GPU engine), "
              f"host working copies of {mib(h['grad_buffer_bytes'])} (CPU engine)")
    rel = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(h["losses"], t["losses"])]
    final_diff = h["losses"][-1] - t["losses"][-1]
    print(f"final loss difference (hipferry - torch): {final_diff:+.2e}; max relative difference over all steps "
          f"{max(rel):.2e}")
    print(f"OffloadAdamW stepped on: {h['step_on']} ({h['step_on_reason']})")
    parity = None
    if a.parity_8bit:
        q = runs["hipferry_8bit"]
        gaps = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(q["losses"], h["losses"])]
        parity = {"max_rel_loss_gap": max(gaps), "final_loss_8bit": q["losses"][-1],
                  "final_loss_float32": h["losses"][-1], "host_state_bytes_8bit": q["host_state_bytes"],
                  "host_state_bytes_float32": h["host_state_bytes"],
                  "host_bytes_per_param_8bit": q["host_bytes_per_param"],
                  "median_step_ms_8bit": q["median_step_ms"], "median_step_ms_float32": h["median_step_ms"]}
        print(f"\n8-bit state parity: largest relative loss gap to float32 state over {len(gaps)} steps "
              f"{max(gaps):.2e} (final {q['losses'][-1]:.4f} vs {h['losses'][-1]:.4f}); host state "
              f"{mib(q['host_state_bytes'])} vs {mib(h['host_state_bytes'])} "
              f"({q['host_bytes_per_param']:.2f} vs {h['host_bytes_per_param']:.2f} bytes/param); "
              f"median step {q['median_step_ms']:.1f} vs {h['median_step_ms']:.1f} ms")

    ok = True
    if a.dtype == "float32":
        agree = max(rel) < 1e-3
        print("losses agree with torch.optim.AdamW (within 1e-3 relative at every step)" if agree else
              "FAILED: the losses differ from torch.optim.AdamW by more than 1e-3 relative")
        ok &= agree
    went_down = h["losses"][-1] < h["losses"][0]
    print(f"loss went down: {h['losses'][0]:.4f} -> {h['losses'][-1]:.4f}" if went_down else
          f"FAILED: the loss did not go down ({h['losses'][0]:.4f} -> {h['losses'][-1]:.4f})")
    ok &= went_down
    if parity is not None:
        close = parity["max_rel_loss_gap"] <= 0.01
        print("8-bit state within 1% of float32 state at every step" if close else
              "FAILED: the 8-bit state's loss differs from float32 state's by more than 1%")
        ok &= close

    if a.json:
        summary = {"device": a.device, "dtype": a.dtype, "params": n_params, "ok": ok,
                   "config": {k: getattr(a, k) for k in ("layers", "width", "heads", "seq", "batch", "steps",
                                                         "vocab", "lr", "untied_head")},
                   "step_on": h["step_on"], "step_on_reason": h["step_on_reason"],
                   "final_loss_diff": final_diff, "max_rel_loss_diff": max(rel), "parity_8bit": parity, "runs": runs}
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"summary: {a.json}")
    if a.plot:
        write_plot(a.plot, runs, f"{n_params / 1e6:.1f} M-parameter GPT on {a.device}, {a.dtype}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
