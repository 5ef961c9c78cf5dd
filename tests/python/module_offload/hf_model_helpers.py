"""Shared helpers of test_hf_models.py: tiny Hugging Face causal LMs built from
configs (no hub access) for four families -- Llama, GPT-2 (Conv1D layers,
``transformer.h``), Qwen2 with tied embeddings, Gemma -- each with a reference
(a ``copy.deepcopy`` taken before ``hipferry.offload_layers``, on the same
device), deterministic batches, a causal-LM loss, bitwise comparisons that
name the tensor that differs, and a training comparison that steps both
models with the same torch optimizer: the reference's optimizer steps
stand-ins of its parameters placed where the offloaded model keeps them (the
host for offloaded blocks), so both sides run the same arithmetic on the same
device (offload_module_helpers.PlacedReference).

Every comparison is ``torch.equal``: both sides are torch's own kernels on the
same machine, with the same weights; the offload only changes where a weight
is stored between uses.
"""
import copy
from typing import Callable, Dict, List

import pytest
import torch
from torch import nn

from conftest import requires_gpu
from offload_module_helpers import PlacedReference, assert_same, assert_same_grads, assert_same_params
from hipferry.torch_private import in_backward

transformers = pytest.importorskip("transformers")

DEVICES = ["cpu", pytest.param("cuda", marks=requires_gpu)]
FAMILIES = ["llama", "gpt2", "qwen2", "gemma"]
VOCAB = 96
LAYERS = 3
BATCH, SEQ = 2, 8
# Where each family keeps its decoder layers (what offload_layers should find).
BLOCKS = {"llama": "model.layers", "gpt2": "transformer.h", "qwen2": "model.layers", "gemma": "model.layers"}
# The projections LoRA adapts (GPT-2's fused qkv is a transformers Conv1D: fan_in_fan_out).
LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"], "qwen2": ["q_proj", "v_proj"],
                "gemma": ["q_proj", "v_proj"]}
_TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # inside the tiny vocabulary


# ------------------------------------------------------------------ models
def make_config(family: str, layers: int = LAYERS, hidden: int = 32, **overrides):
    """A tiny config of ``family``: width ``hidden``, ``layers`` decoder layers, 4 heads,
    no dropout, eager attention (one code path, the same on every machine)."""
    t = transformers
    common = dict(vocab_size=VOCAB, attn_implementation="eager", **_TOKENS)
    if family == "gpt2":
        kw = dict(n_embd=hidden, n_layer=layers, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0, **common)
        kw.update(overrides)
        return t.GPT2Config(**kw)
    kw = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, **common)
    if family == "llama":
        cls = t.LlamaConfig
    elif family == "qwen2":
        cls, kw["tie_word_embeddings"] = t.Qwen2Config, True
    elif family == "gemma":
        cls, kw["head_dim"] = t.GemmaConfig, hidden // 4
    else:
        raise ValueError(f"unknown family {family!r}")
    kw.update(overrides)
    return cls(**kw)


def model_class(family: str):
    t = transformers
    return {"llama": t.LlamaForCausalLM, "gpt2": t.GPT2LMHeadModel, "qwen2": t.Qwen2ForCausalLM,
            "gemma": t.GemmaForCausalLM}[family]


def make_model(family: str, seed: int = 0, device="cpu", **config):
    """``family``'s causal LM from a tiny config, random weights drawn from ``seed``, on ``device``."""
    torch.manual_seed(seed)
    model = model_class(family)(make_config(family, **config))
    return model.to(device)


def model_and_reference(family: str, device, seed: int = 0, **config):
    """A tiny model on ``device`` and its deep copy (the reference, never offloaded)."""
    model = make_model(family, seed, device, **config)
    return model, copy.deepcopy(model)


def block_prefix(family: str, peft: bool = False) -> str:
    return ("base_model.model." if peft else "") + BLOCKS[family]


def expected_block_names(family: str, layers: int = LAYERS, peft: bool = False) -> List[str]:
    return [f"{block_prefix(family, peft)}.{i}" for i in range(layers)]


def inner_model(model: nn.Module) -> nn.Module:
    """The decoder under the LM head (``model.model``, GPT-2: ``model.transformer``)."""
    return model.transformer if hasattr(model, "transformer") else model.model


def block_params(model: nn.Module, handle) -> Dict[str, nn.Parameter]:
    """The parameters of the offloaded blocks, by name (what lives on the host)."""
    prefixes = tuple(n + "." for n in handle.block_names)
    return {n: p for n, p in model.named_parameters() if n.startswith(prefixes)}


@torch.no_grad()
def round_blocks_(model: nn.Module, family: str, dtype: torch.dtype, peft: bool = False) -> None:
    """Rounds the floating weights of ``model``'s decoder layers to ``dtype`` in place
    (keeping their dtype): the values an offload with host ``dtype`` computes with."""
    prefix = block_prefix(family, peft) + "."
    for n, p in model.named_parameters():
        if n.startswith(prefix) and p.dtype.is_floating_point:
            p.copy_(p.to(dtype).to(p.dtype))


def lora_config(family: str, **kw):
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[family], lora_dropout=0.0,
                           init_lora_weights=False, fan_in_fan_out=family == "gpt2", **kw)


def add_lora(model: nn.Module, family: str, seed: int = 1):
    """``peft.get_peft_model`` with a non-zero adapter (``init_lora_weights=False``)
    drawn from ``seed``: the same adapter for a model and its reference."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    return peft.get_peft_model(model, lora_config(family))


# ------------------------------------------------------------------ running
def batch(step: int = 0, device="cpu", batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3000 + step)
    return torch.randint(3, VOCAB, (batch, seq), generator=gen).to(device)


def causal_lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def hidden_state_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A loss through the decoder only (``model.model`` / ``model.transformer``),
    not through the top-level model."""
    return inner_model(model)(input_ids=ids).last_hidden_state.float().square().mean()


@torch.no_grad()
def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


def generate(model: nn.Module, ids: torch.Tensor, new_tokens: int = 5) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0)


def enable_checkpointing(model: nn.Module, reentrant: bool) -> None:
    """HF's gradient checkpointing of every decoder layer; with ``reentrant`` the
    embeddings' output must require grad, or the reentrant checkpoint has no
    input that does."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()


# ------------------------------------------------------------------ comparisons
def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().cpu().double() - b.detach().cpu().double()).abs().max().item()


# ------------------------------------------------------------------ training
def trainable(model: nn.Module) -> List[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def adamw(**kw) -> Callable[[List[torch.Tensor]], torch.optim.Optimizer]:
    kw.setdefault("lr", 1e-2)
    kw.setdefault("weight_decay", 0.1)
    if not kw.get("fused"):
        kw.setdefault("foreach", True)
    return lambda params: torch.optim.AdamW(params, **kw)


def train_and_compare(model: nn.Module, ref: nn.Module, device, steps: int, make_opt=None,
                      loss_fn: Callable = causal_lm_loss, first_step: int = 0) -> None:
    """``steps`` optimizer steps of both models on the same batches: losses and
    gradients bitwise equal each step, then every parameter after the step."""
    make_opt = make_opt or adamw()
    opt, ref_opt = make_opt(trainable(model)), PlacedReference(ref, model, make_opt)
    for step in range(first_step, first_step + steps):
        ids = batch(step, device)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad()
        loss = loss_fn(model, ids)
        loss.backward()
        ref_loss = loss_fn(ref, ids)
        ref_loss.backward()
        assert_same(loss, ref_loss, f"loss of step {step}")
        assert_same_grads(model, ref)
        opt.step()
        ref_opt.step()
        assert_same_params(model, ref, f"after step {step}:")


# ------------------------------------------------------------------ what backward reads
class WeightsReadInBackward:
    """Records, for every submodule of the offloaded blocks that has parameters of
    its own (Linear, GPT-2's Conv1D, norms), the tensors its forward reads
    (``mod.<name>`` at its forward pre-hook) when it runs inside a backward --
    activation checkpointing recomputing it. ``from_host()`` lists those that
    are the host parameters themselves or share their storage."""

    def __init__(self, model: nn.Module, handle):
        self.seen: List[tuple] = []
        self.host = {id(p): n for n, p in block_params(model, handle).items()}
        self.host_storage = {p.untyped_storage().data_ptr(): n for n, p in block_params(model, handle).items()}
        self.hooks = []
        prefixes = tuple(n + "." for n in handle.block_names)
        for name, mod in model.named_modules():
            if name.startswith(prefixes) and any(p is not None for p in mod._parameters.values()):
                self.hooks.append(mod.register_forward_pre_hook(self._record(name)))

    def _record(self, name: str):
        def hook(mod, args):
            if in_backward():
                for attr in mod._parameters:
                    t = getattr(mod, attr)
                    if t is not None:
                        self.seen.append((f"{name}.{attr}", t))
        return hook

    def from_host(self) -> List[str]:
        return [n for n, t in self.seen
                if id(t) in self.host or t.untyped_storage().data_ptr() in self.host_storage]

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
