"""Shared helpers of the module-offload tests (test_offload_layers*.py,
test_offload_activations.py): small deterministic models whose repeated
blocks sit in an nn.ModuleList (a GPT-like model with optional dropout and
activation checkpointing, MLPs with blocks of equal or different widths, with
weights tied between blocks and between a block and the head, with buffers
updated in train mode), the device parametrization, a model with an identical
reference copy on the same device, bitwise comparisons that name the tensor
that differs, and a reference optimizer that steps copies of the reference's
parameters placed where the offloaded model keeps its parameters (host for
offloaded blocks), so both sides run the same optimizer arithmetic."""
import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from conftest import requires_gpu

DEVICES = ["cpu", pytest.param("cuda", marks=requires_gpu)]
BATCH = 4


# ------------------------------------------------------------------ models
class GPTBlock(nn.Module):
    """Pre-norm causal self-attention + GELU MLP, both residual."""

    def __init__(self, d, heads, dropout):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~causal, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class TinyGPT(nn.Module):
    """Token + position embedding, ``n_blocks`` GPTBlocks, final LayerNorm, head.
    ``checkpoint=True`` runs every block under non-reentrant activation checkpointing."""

    def __init__(self, vocab=13, d=16, heads=2, n_blocks=4, seq=6, dropout=0.0, checkpoint=False):
        super().__init__()
        self.vocab, self.seq, self.checkpoint = vocab, seq, checkpoint
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.1 * torch.randn(seq, d))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([GPTBlock(d, heads, dropout) for _ in range(n_blocks)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.drop(self.tok(idx) + self.pos[:idx.shape[1]])
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if self.checkpoint else blk(x)
        return self.head(self.ln_f(x))

    def example(self, step=0, device="cpu"):
        gen = torch.Generator().manual_seed(1000 + step)
        return torch.randint(self.vocab, (BATCH, self.seq), generator=gen).to(device)


class MLPBlock(nn.Module):
    """x + fc2(act(fc1(x))), with optional dropout."""

    def __init__(self, d, hidden, dropout=0.0, bias=True):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden, bias=bias), nn.Linear(hidden, d, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.tanh(self.fc1(x))))


class BufferBlock(nn.Module):
    """An MLP block with BatchNorm1d and a registered buffer (a running mean of
    its input) that forward reads and, in train mode, updates."""

    def __init__(self, d, hidden):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.bn = nn.BatchNorm1d(hidden)
        self.register_buffer("ema", torch.zeros(d))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x + self.fc2(torch.tanh(self.bn(self.fc1(x)))) + 0.5 * self.ema


class MLPNet(nn.Module):
    """Linear(n_in, d) -> blocks (ModuleList) -> head Linear(d, n_out). ``hidden``: one
    width per block (different widths: blocks of different sizes); ``batch``: rows of
    example() (large: large activations)."""

    def __init__(self, d=16, hidden=(32, 32, 32, 32), n_in=8, n_out=5, dropout=0.0, bias=True, block=None,
                 batch=BATCH, checkpoint=False):
        super().__init__()
        self.n_in, self.batch, self.checkpoint = n_in, batch, checkpoint
        self.inp = nn.Linear(n_in, d)
        make = block or (lambda h: MLPBlock(d, h, dropout, bias))
        self.blocks = nn.ModuleList([make(h) for h in hidden])
        self.head = nn.Linear(d, n_out)

    def forward(self, x):
        x = self.inp(x)
        for i, blk in enumerate(self.blocks):
            # checkpoint=True: every other block under activation checkpointing, the rest saved normally.
            x = checkpoint(blk, x, use_reentrant=False) if self.checkpoint and i % 2 else blk(x)
        return self.head(x)

    def example(self, step=0, device="cpu"):
        gen = torch.Generator().manual_seed(2000 + step)
        return torch.randn(self.batch, self.n_in, generator=gen).to(device)


class TiedNet(MLPNet):
    """MLPNet whose blocks 0 and 2 share fc1.weight, and whose head (Linear(d, hidden))
    uses the last block's fc1.weight."""
    SHARED_BETWEEN_BLOCKS = "blocks.0.fc1.weight"
    SHARED_WITH_HEAD = "blocks.3.fc1.weight"

    def __init__(self, d=16, hidden=32):
        super().__init__(d=d, hidden=(hidden,) * 4)
        self.blocks[2].fc1.weight = self.blocks[0].fc1.weight
        self.head = nn.Linear(d, hidden)
        self.head.weight = self.blocks[3].fc1.weight


def make_gpt(**kw):
    return TinyGPT(**kw)


def make_mlp(**kw):
    return MLPNet(**kw)


def make_buffer_net(d=16, hidden=(32, 24, 32)):
    return MLPNet(d=d, hidden=hidden, block=lambda h: BufferBlock(d, h))


def make_tied():
    return TiedNet()


def model_and_reference(factory, device, seed=0, **kw):
    """``factory(**kw)`` built with a fixed seed, moved to ``device``, and a deep copy
    (the reference, left unmodified) on the same device."""
    torch.manual_seed(seed)
    model = factory(**kw).to(device)
    return model, copy.deepcopy(model)


# ------------------------------------------------------------------ running
def call(model, x, seed=None):
    """model(x), with torch (and the GPU generators) seeded first when ``seed`` is given:
    dropout then draws the same masks in both models."""
    if seed is not None:
        torch.manual_seed(seed)
    return model(x)


def loss_of(out):
    return out.float().square().mean()


def train_step(model, x, seed=None):
    """Forward, loss, backward; returns the output (detached)."""
    out = call(model, x, seed)
    loss_of(out).backward()
    return out.detach()


# ------------------------------------------------------------------ comparisons
def assert_same(a, b, what):
    a, b = a.detach(), b.detach()
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    a, b = a.cpu(), b.cpu()
    if not torch.equal(a, b):
        diff = (a.double() - b.double()).abs().max().item()
        raise AssertionError(f"{what} differs (max abs difference {diff})")


def assert_same_outputs(out, ref_out, what="output"):
    assert_same(out, ref_out, what)


def assert_same_grads(model, ref, cast=False):
    """Every parameter's .grad bitwise equal to the reference's (None where it is None);
    with ``cast`` the reference's gradient is first cast to the dtype of the model's
    (a host dtype keeps the gradients of offloaded weights in that dtype)."""
    named, ref_named = list(model.named_parameters()), list(ref.named_parameters())
    assert [n for n, _ in named] == [n for n, _ in ref_named]
    assert any(p.grad is not None for _, p in ref_named), "the reference has no gradients: nothing compared"
    for (name, p), (_, r) in zip(named, ref_named):
        assert (p.grad is None) == (r.grad is None), f"grad of {name}: {p.grad is None=} vs {r.grad is None=}"
        if r.grad is not None:
            assert_same(p.grad, r.grad.to(p.grad.dtype) if cast else r.grad, f"grad of {name}")


def assert_same_params(model, ref, what="parameter"):
    named, ref_named = list(model.named_parameters()), list(ref.named_parameters())
    assert [n for n, _ in named] == [n for n, _ in ref_named]
    for (name, p), (_, r) in zip(named, ref_named):
        assert_same(p, r, f"{what} {name}")


def assert_same_buffers(model, ref):
    named, ref_named = list(model.named_buffers()), list(ref.named_buffers())
    assert [n for n, _ in named] == [n for n, _ in ref_named]
    for (name, b), (_, r) in zip(named, ref_named):
        assert_same(b, r, f"buffer {name}")


def assert_same_training_steps(model, ref, device, steps, label="output", also=None):
    """`steps` training steps of both models on the same batches: outputs and
    every gradient bitwise equal each step (and `also(model, ref)` if given)."""
    for step in range(steps):
        x = model.example(step, device)
        model.zero_grad(), ref.zero_grad()
        assert_same_outputs(train_step(model, x), train_step(ref, x), f"{label} {step}")
        assert_same_grads(model, ref)
        if also is not None:
            also(model, ref)


def snapshot_params(model):
    """name -> (parameter object, device, dtype, value clone)."""
    return {n: (p, p.device, p.dtype, p.detach().clone()) for n, p in model.named_parameters()}


def block_param_names(model, blocks_attr="blocks"):
    return [n for n, _ in model.named_parameters() if n.startswith(blocks_attr + ".")]


def padded_bytes(module):
    """What a block of fp32 weights takes in a ring slot: each weight rounded up to 256 bytes."""
    return sum((p.numel() * p.element_size() + 255) // 256 * 256 for p in module.parameters())


def pool_in_use(pool):
    """(allocated bytes, live blocks) of a pool once dead tensors are collected (and, on
    a GPU, the copies that read pool blocks have completed)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        pool.process_events()
    s = pool.stats()
    return s["allocated_bytes"], s["live_blocks"]


# ------------------------------------------------------------------ optimizers
class PlacedReference:
    """The reference side of a training comparison: ``make_opt`` over stand-ins of the
    reference's trainable parameters (frozen ones, e.g. a LoRA base, are left out)
    placed where the offloaded model keeps the corresponding parameters (on the host
    for offloaded blocks). Device-placed parameters are their own stand-ins. step()
    hands the reference's gradients to the stand-ins, steps, and writes the results
    back -- the arithmetic the offloaded model's optimizer does."""

    def __init__(self, ref, model, make_opt):
        self.pairs = []
        for (name, r), (mname, p) in zip(ref.named_parameters(), model.named_parameters()):
            assert name == mname
            if not r.requires_grad:
                continue
            stand_in = r if r.device == p.device else r.detach().to(p.device).requires_grad_(True)
            self.pairs.append((r, stand_in))
        self.opt = make_opt([s for _, s in self.pairs])

    def zero_grad(self):
        for r, s in self.pairs:
            r.grad = s.grad = None

    @torch.no_grad()
    def step(self):
        for r, s in self.pairs:
            if s is not r and r.grad is not None:
                s.grad = r.grad.to(s.device)
        self.opt.step()
        for r, s in self.pairs:
            if s is not r:
                r.copy_(s)
