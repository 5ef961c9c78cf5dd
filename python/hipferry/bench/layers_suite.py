"""Suite `layers`: hipferry.offload_layers against keeping the model on the device and against
accelerate's two ways of running a model bigger than the device.

Greedy generation (batch 1, fp32) with a small GPT-style decoder (token + position embeddings,
pre-LN blocks with hand-written attention in an nn.ModuleList, final LayerNorm, LM head). No KV
cache: every new token re-runs the whole context (prompt + tokens so far), so each token is one
pass over all the weights and the offloaded runs are weight-transfer-bound. Contenders, each a copy
of the same weights:
  - "no offload": the model on the device;
  - ``hipferry.offload_layers(model, prefetch=2)`` and ``prefetch=1``;
  - "accelerate device_map (same budget)": accelerate's big-model dispatch with the device memory
    hipferry prefetch=2 holds (its ring + its non-offloaded weights) as the budget:
    ``infer_auto_device_map(model, max_memory={gpu: budget, "cpu": ...}, no_split_module_classes=
    ["_Block"])`` then ``dispatch_model(model, device_map, main_device=gpu)``. The blocks that fit stay
    on the device; each leaf module of the others gets a hook that copies its weights to the device
    (synchronously, from pageable memory) before its forward and drops them after. This is the
    equal-device-memory comparison the issue's ">= 3x accelerate" target means.
  - "accelerate cpu_offload": ``accelerate.cpu_offload(model, execution_device=device)``, every
    leaf module hooked that way; it holds one leaf's weights at a time, far less device memory
    than the others (kept as the reference accelerate users reach for first).
Hand-written attention: accelerate loads weights per leaf module around its forward, which
nn.MultiheadAttention's functional use of out_proj would defeat. Every contender's tokens must
equal the no-offload tokens (checked, raises).

On a CPU-only machine the device map is still built for a GPU of that budget (the blocks it keeps
are reported), but dispatch_model offloads only when the main device is not the CPU: there every
module runs in place behind the same hooks, nothing is copied.

Times: best of interleaved rounds after one warm-up run each (the warm-up also does the
correctness check and, on a GPU, the device-memory measurement); wall clock, with a synchronize
before and after on a GPU.
"""
import contextlib
import copy
import logging
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .harness import Context, SuiteResult, best_of_interleaved, suite
from .offload_suite import MiB, NO, _allocated, _device, _mib, _Progress, _run_with_peak, _timer

HF = "hipferry offload_layers(prefetch={})"
ACC = "accelerate cpu_offload"
ACC_MAP = "accelerate device_map (same budget)"
_HOST_BUDGET = 1 << 50  # the "cpu" entry of max_memory: host memory is not what is compared


class _Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class _Decoder(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, heads: int, max_len: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(depth))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def _layers_config(ctx: Context, dev: torch.device) -> dict:
    if ctx.quick:
        return dict(vocab=256, width=128, depth=4, heads=4, prompt=8, tokens=8, repeats=2)
    if dev.type == "cuda":  # 24 x 192 MiB of fp32 blocks: 4.5 GiB of weights per token
        return dict(vocab=4096, width=2048, depth=24, heads=16, prompt=16, tokens=32, repeats=min(ctx.repeats, 3))
    return dict(vocab=2048, width=768, depth=12, heads=12, prompt=16, tokens=16, repeats=min(ctx.repeats, 3))


def _generate(model: nn.Module, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    ids = prompt
    with torch.no_grad():
        for _ in range(tokens):
            nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    return ids


def _cpu_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).to("cpu")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _under(name: str, keys) -> bool:
    """Whether a parameter / module name is at or below one of the device-map keys ("" is the whole model)."""
    return any(k == "" or name == k or name.startswith(k + ".") for k in keys)


def _bytes_under(model: nn.Module, keys) -> int:
    return _nbytes(t for n, t in [*model.named_parameters(), *model.named_buffers()] if _under(n, keys))


@contextlib.contextmanager
def _quiet_accelerate():
    # Expected notices: "Device 0 is not available" (a map built for a GPU on a CPU-only machine) and
    # "Some parameters are on the meta device because they were offloaded" (what dispatch is for).
    loggers = [logging.getLogger(n) for n in ("accelerate.utils.modeling", "accelerate.big_modeling")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _dispatch_within_budget(master: nn.Module, dev: torch.device, budget: int) -> Tuple[nn.Module, dict]:
    """A copy of master dispatched by accelerate with `budget` bytes of device memory, and its device map.
    infer_auto_device_map keeps room for the largest block (to load offloaded ones into) and fills the
    rest in module order; everything after the first module that does not fit goes to "cpu"."""
    from accelerate import dispatch_model, infer_auto_device_map
    m = _cpu_copy(master)
    gpu = dev.index if dev.type == "cuda" else 0
    with _quiet_accelerate():
        device_map = infer_auto_device_map(m, max_memory={gpu: budget, "cpu": _HOST_BUDGET},
                                           no_split_module_classes=[_Block.__name__])
        if dev.type == "cuda":
            return dispatch_model(m, device_map, main_device=dev), device_map
        # No GPU: dispatch_model with main_device "cpu" offloads nothing (every module runs where it is);
        # force_hooks keeps accelerate's hooks on the forward path, as on a GPU.
        return dispatch_model(m, {k: "cpu" for k in device_map}, main_device="cpu", force_hooks=True), device_map


def _split_map(device_map: dict, depth: int) -> Dict[bool, str]:
    """{on the device?: "tok, pos, 2 of 4 blocks"} for the notes."""
    names: Dict[bool, List[str]] = {True: [], False: []}
    blocks = {True: 0, False: 0}
    for key, where in device_map.items():
        on = where not in ("cpu", "disk")
        if key in ("", "blocks"):
            blocks[on] += depth
            if key == "":
                names[on].append("everything else")
        elif key.startswith("blocks."):
            blocks[on] += 1
        else:
            names[on].append(key)
    return {on: ", ".join(names[on] + [f"{blocks[on]} of {depth} blocks"]) for on in (True, False)}


@suite("layers")
def layers_suite(ctx: Context) -> SuiteResult:
    from ..module_offload import offload_layers
    dev = _device(ctx)
    cfg = _layers_config(ctx, dev)
    notes: List[str] = []
    step = _Progress(ctx, "layers", 4)
    step(f"build a {cfg['depth']}-block decoder of width {cfg['width']} (fp32) and its offloaded copies")
    torch.manual_seed(0)
    with torch.device(dev):  # initialized where it runs: fast on a GPU
        master = _Decoder(cfg["vocab"], cfg["width"], cfg["depth"], cfg["heads"], cfg["prompt"] + cfg["tokens"])
    master.eval()
    prompt = torch.randint(cfg["vocab"], (1, cfg["prompt"]), generator=torch.Generator().manual_seed(1)).to(dev)
    block_bytes = _nbytes(master.blocks.parameters())
    # What offload_layers keeps on the device besides its ring: embeddings, final LN, head, buffers.
    rest_bytes = _nbytes([*master.parameters(), *master.buffers()]) - block_bytes
    leaf_bytes = {n: _nbytes(m.parameters(recurse=False)) for n, m in master.named_modules()}
    models: Dict[str, nn.Module] = {NO: master}
    # Weight bytes each contender holds on the device at once: measured after setup on a GPU (resident);
    # the estimate stands in for device memory on the CPU.
    estimate: Dict[str, int] = {NO: rest_bytes + block_bytes}
    resident: Dict[str, int] = {NO: rest_bytes + block_bytes}
    handles = {}
    for prefetch in (2, 1):
        name, m = HF.format(prefetch), _cpu_copy(master)
        before = _allocated(dev)
        handles[name] = offload_layers(m, prefetch=prefetch, device=dev)
        resident[name] = _allocated(dev) - before  # the ring + embeddings, final LN, head
        estimate[name] = handles[name].stats()["device_bytes"] + rest_bytes
        models[name] = m
    budget, device_map = estimate[HF.format(2)], None
    try:
        from accelerate import cpu_offload
    except ImportError as e:
        notes.append(f"accelerate not importable ({e}): its contenders are missing")
    else:
        before = _allocated(dev)
        models[ACC_MAP], device_map = _dispatch_within_budget(master, dev, budget)
        resident[ACC_MAP] = _allocated(dev) - before
        on_device = [k for k, where in device_map.items() if where not in ("cpu", "disk")]
        offloaded = [k for k in device_map if k not in on_device]
        offloaded_leaves = [b for n, b in leaf_bytes.items() if _under(n, offloaded)]
        estimate[ACC_MAP] = _bytes_under(master, on_device) + max(offloaded_leaves, default=0)
        m = _cpu_copy(master)
        before = _allocated(dev)
        models[ACC] = cpu_offload(m, execution_device=dev)
        resident[ACC] = _allocated(dev) - before
        estimate[ACC] = max(leaf_bytes.values())  # one leaf module's weights at a time

    step(f"warm-up: generate {cfg['tokens']} tokens with each of {len(models)} contenders, check they agree")
    peaks, expected = {}, None
    for name, m in models.items():
        ids, peak = _run_with_peak(dev, lambda m=m: _generate(m, prompt, cfg["tokens"]))
        peaks[name] = estimate[name] if peak is None else resident[name] + peak
        got = ids[0, cfg["prompt"]:].tolist()
        if expected is None:
            expected = got
        elif got != expected:
            raise RuntimeError(f"layers: {name} generated {got}, but the model on the device generated {expected}")
    before = {k: h.stats() for k, h in handles.items()}

    step(f"{len(models)} contenders, {cfg['repeats']} interleaved rounds of {cfg['tokens']} tokens")
    best = best_of_interleaved({k: _timer(dev, lambda m=m: _generate(m, prompt, cfg["tokens"]))
                                for k, m in models.items()}, cfg["repeats"])
    step("results")
    tps = {k: cfg["tokens"] / s for k, s in best.items()}
    rows = []
    for name, secs in best.items():
        r = {"contender": name, "tokens_per_s": tps[name], "seconds": secs, "tokens": cfg["tokens"],
             "device_MiB": _mib(peaks[name]), "vs_no_offload": tps[name] / tps[NO]}
        for col, other in (("vs_device_map", ACC_MAP), ("vs_cpu_offload", ACC)):
            r[col] = tps[name] / tps[other] if other in tps else "n/a"
        if name in handles:
            h, b = handles[name].stats(), before[name]
            r.update(ring_MiB=h["device_bytes"] / MiB, hits=h["hits"] - b["hits"], stalls=h["stalls"] - b["stalls"])
        rows.append(r)
    ring = handles[HF.format(2)].stats()["device_bytes"]
    for h in handles.values():
        h.undo()
    notes += _layers_notes(cfg, dev, tps, ring, rest_bytes, block_bytes, max(leaf_bytes.values()), device_map)
    plots = [{"kind": "bar", "x": "contender", "y": "tokens_per_s", "ylabel": "tokens/s (higher is better)",
              "title": f"greedy decode, {cfg['depth']} blocks x width {cfg['width']} fp32, batch 1, on {dev.type}"}]
    if dev.type == "cuda":
        plots.append({"kind": "bar", "x": "contender", "y": "device_MiB", "ylabel": "peak device MiB",
                      "title": "device memory while generating (resident + peak growth)"})
    return SuiteResult(rows=rows, plots=plots, notes=notes,
                       columns=["contender", "tokens_per_s", "seconds", "tokens", "device_MiB", "ring_MiB",
                                "vs_device_map", "vs_cpu_offload", "vs_no_offload", "hits", "stalls"])


def _layers_notes(cfg, dev, tps, ring, rest_bytes, block_bytes, largest_leaf, device_map) -> List[str]:
    hf2 = HF.format(2)
    notes = [f"model: {cfg['depth']} pre-LN blocks, width {cfg['width']}, vocab {cfg['vocab']}, fp32; "
             f"{block_bytes / MiB:.0f} MiB of block weights cross the link per token when offloaded; greedy decode "
             f"of {cfg['tokens']} tokens after a {cfg['prompt']}-token prompt, batch 1, no KV cache (each token "
             "re-runs the whole context); all contenders generated the same tokens (checked)",
             f"tokens_per_s = {cfg['tokens']} / best of {cfg['repeats']} interleaved rounds; vs_device_map, "
             "vs_cpu_offload and vs_no_offload = the row's tokens/s over that contender's (> 1: the row is faster)"]
    if device_map is not None:
        where = _split_map(device_map, cfg["depth"])
        notes.append(f"equal device memory: '{ACC_MAP}' got hipferry prefetch=2's device memory as its budget, "
                     f"{(ring + rest_bytes) / MiB:.2f} MiB = its ring {ring / MiB:.2f} MiB + its non-offloaded "
                     f"weights {rest_bytes / MiB:.2f} MiB (embeddings, final LN, head), as max_memory of "
                     "infer_auto_device_map (no_split_module_classes=[block]); it reserves room for the largest "
                     f"block and kept on the device: {where[True]}; offloaded to the CPU: {where[False]}, whose "
                     "leaf modules dispatch_model's hooks copy to the device synchronously, one at a time, before "
                     "each forward. vs_device_map is the equal-memory comparison the >= 3x target refers to; "
                     f"'{ACC}' holds one leaf module's weights at a time (at most {largest_leaf / MiB:.2f} MiB), "
                     "far less device memory: vs_cpu_offload is for reference")
        ratio = tps[hf2] / tps[ACC_MAP]
        other = f"vs '{ACC}' (less device memory): {tps[hf2] / tps[ACC]:.2f}x"
        if dev.type == "cuda":
            notes.append("target hipferry prefetch=2 >= 3x accelerate tokens/s at equal device memory (vs_device_map, "
                         "GPU): " + ("met" if ratio >= 3 else "MISSED") + f" ({ratio:.2f}x); {other}")
            r_off = tps[hf2] / tps[ACC]
            notes.append("target as the issue words it, >= 3x accelerate cpu_offload tokens/s (vs_cpu_offload, GPU; "
                         "cpu_offload holds less device memory): " + ("met" if r_off >= 3 else "MISSED") +
                         f" ({r_off:.2f}x)")
        else:
            notes.append("target hipferry prefetch=2 >= 3x accelerate tokens/s at equal device memory (vs_device_map) "
                         f"applies on a GPU only; here (CPU) it is {ratio:.2f}x ({other}) and measures overhead: "
                         "accelerate copies nothing on the CPU (dispatch_model offloads only to a main device that "
                         "is not the CPU, so every module runs in place behind its hooks; cpu_offload's .to('cpu') "
                         "returns the weights) while hipferry copies every block into its ring on a worker thread, "
                         "competing with compute for the cores")
    if dev.type == "cuda":
        notes.append("device_MiB = bytes resident on the device after setup + the peak growth while generating "
                     "(torch.cuda.max_memory_allocated after reset_peak_memory_stats): no offload holds every "
                     "weight; hipferry its ring (prefetch+1 blocks) + the non-offloaded weights; accelerate "
                     "device_map its resident modules + one offloaded leaf module at a time; cpu_offload one leaf "
                     "module at a time. accelerate copies from pageable memory, synchronously, module by module")
    else:
        notes.append("CPU: no device memory to measure; device_MiB = the weight bytes each contender would hold on "
                     "a GPU at once, activations not counted: every weight (no offload), the ring + non-offloaded "
                     "weights (hipferry), the resident modules + the largest offloaded leaf module (accelerate "
                     "device_map), the largest leaf module (accelerate cpu_offload)")
    return notes
