"""LoRA fine-tuning of a Hugging Face Llama with its decoder layers offloaded by hipferry, trained by Trainer.

A tiny Llama is built from a ``LlamaConfig`` (random weights; nothing is
downloaded), gets LoRA adapters from peft, and ``hipferry.offload_layers``
moves the weights of its decoder layers into pinned host memory: each layer
runs from a small ring of device buffers that the next layers copy into
while one computes. ``transformers.Trainer`` then trains it as usual, with
``optimizer_cls_and_kwargs=(hipferry.optim.OffloadAdamW, {...})`` so the
optimizer state lives on the host too. The data: windows of a paragraph
bundled below, byte by byte (byte-level tokens, vocabulary 256).

    python examples/hf_finetune_offload.py [--steps 20] [--device auto|cpu|cuda] [--layers 4] [--hidden 64]
                                           [--seq 32] [--batch 4] [--lr 3e-3] [--prefetch 2]
                                           [--gradient-checkpointing] [--json PATH]

Prints the loss of every step and, at the end, what moved (handle.stats()).
On the CPU the default run takes a few seconds after the imports.
Exit code 0 when training ran and its losses are finite, 1 otherwise, 2 on a bad argument.
"""
import argparse
import json
import math
import sys
import tempfile
import time
import warnings

import torch

import hipferry

TEXT = b"""\
The ferry leaves the east bank at first light, when the river is still grey and the gulls are asleep on the pilings.
It carries whatever the morning brings: a baker with two crates of bread, a schoolteacher who reads on the crossing,
a farmer with a goat that will not stand still, and now and then a truck so heavy that the deck sinks a hand's width
lower in the water. The pilot has made the crossing so many times that she no longer looks at the far shore. She
watches the current instead, the way it folds around the sandbar in spring and slides past it in autumn.
"""


def gpu_available() -> bool:
    return torch.cuda.is_available() and hipferry.device_count() > 0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the layers run (default: cuda if available, else cpu)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (Trainer max_steps)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (a multiple of 4: 4 attention heads)")
    p.add_argument("--seq", type=int, default=32, help="tokens (bytes) per sequence")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3, help="OffloadAdamW learning rate")
    p.add_argument("--prefetch", type=int, default=2, help="layers copied ahead of the one running")
    p.add_argument("--gradient-checkpointing", action="store_true", help="HF gradient checkpointing of every layer")
    p.add_argument("--json", metavar="PATH", help="write a summary (losses, stats) as JSON")
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if gpu_available() else "cpu"
    if a.device == "cuda" and not gpu_available():
        p.error("--device cuda: no GPU visible to torch and hipferry")
    problems = [(a.steps < 1, f"--steps must be >= 1, got {a.steps}"),
                (a.layers < 2, f"--layers must be >= 2 (blocks to offload), got {a.layers}"),
                (a.hidden < 4 or a.hidden % 4, f"--hidden must be a positive multiple of 4, got {a.hidden}"),
                (not 2 <= a.seq < len(TEXT), f"--seq must be in [2, {len(TEXT) - 1}] (the bundled text's length)"),
                (a.batch < 1, f"--batch must be >= 1, got {a.batch}"),
                (not a.lr > 0, f"--lr must be > 0, got {a.lr}"),
                (a.prefetch < 0, f"--prefetch must be >= 0, got {a.prefetch}")]
    for bad, message in problems:
        if bad:
            p.error(message)
    return a


def make_model(a):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=256, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                         num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max(64, a.seq), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def make_dataset(a):
    """Windows of the bundled text, as a list of dicts (what Trainer's default collator stacks)."""
    data = torch.frombuffer(bytearray(TEXT), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, len(data) - a.seq, (max(8, a.batch * 4),), generator=g).tolist()
    return [{"input_ids": data[s:s + a.seq], "labels": data[s:s + a.seq]} for s in starts]


def main(argv=None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    from peft import LoraConfig, get_peft_model
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()  # the tiny config's notes, not the example's output
    warnings.filterwarnings("ignore", category=FutureWarning)  # renames announced for transformers v6

    model = make_model(a)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                             lora_dropout=0.0))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    handle = hipferry.offload_layers(model, device=a.device, prefetch=a.prefetch)
    s = handle.stats()
    print(f"model: Llama, {a.layers} layers of width {a.hidden}, {total} parameters ({trainable} LoRA, trainable)")
    print(f"offloaded {s['blocks']} blocks ({handle.block_names[0]} ... {handle.block_names[-1]}): "
          f"{s['host_bytes']} bytes in pinned host memory, a ring of {s['ring_slots']} x {s['slot_bytes']} bytes "
          f"on {handle.device}")

    losses = []

    class Progress(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))
                print(f"[step {state.global_step:4d}/{state.max_steps}] loss {losses[-1]:.4f}", flush=True)

    with tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(output_dir=out_dir, use_cpu=a.device == "cpu", max_steps=a.steps,
                                 per_device_train_batch_size=a.batch, logging_steps=1, report_to=[],
                                 save_strategy="no", seed=0, disable_tqdm=True, lr_scheduler_type="constant",
                                 gradient_checkpointing=a.gradient_checkpointing)
        trainer = Trainer(model=model, args=args, train_dataset=make_dataset(a), callbacks=[Progress()],
                          optimizer_cls_and_kwargs=(hipferry.optim.OffloadAdamW, {"lr": a.lr}))
        trainer.remove_callback(PrinterCallback)  # Progress prints each step instead
        trainer.train()

    s = handle.stats()
    print("what moved (handle.stats()):")
    print(f"  weights host->device: {s['bytes_moved']} bytes in {s['fetches']} copies "
          f"({s['prefetches']} ahead of use); uses: {s['hits']} hits, {s['late']} late, {s['misses']} misses, "
          f"{s['reused']} reused")
    print(f"  gradients device->host: {s['grad_bytes_moved']} bytes")
    print(f"  device memory of the offloaded weights: {s['device_bytes']} bytes (the ring), "
          f"host: {s['host_bytes']} bytes")
    ok = len(losses) == a.steps and all(math.isfinite(x) for x in losses)
    if losses:
        print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}"
              f"{' (went down)' if losses[-1] < losses[0] else ''}")
    print(f"done in {time.perf_counter() - t0:.1f} s on {a.device}: {'ok' if ok else 'FAILED'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": a.device, "ok": ok, "losses": losses, "trainable_params": trainable,
                       "params": total, "block_names": handle.block_names,
                       "stats": {k: v for k, v in s.items() if isinstance(v, (int, float, str))}}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
