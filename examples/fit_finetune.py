"""Say what fits, pick it, train it: hipferry.plan on a small Llama built from a config.

The planner measures this machine once (cached), runs one forward and backward
of the model on a batch, estimates every home of the AdamW state (torch,
host float32, host 8-bit, disk float32, disk 8-bit) under the budgets given
(on a GPU whose budget is short, also with blocks streamed and activations
offloaded), prints the table, and builds the fastest placement that fits. The script then
trains on a repeating token pattern (the loss goes down) and prints the
prediction beside what it measured: peak resident growth and step time.

    python examples/fit_finetune.py [--hidden 512] [--layers 8] [--vocab 8192] [--batch 2] [--seq 128]
                                    [--host-memory 24GiB] [--state-dir DIR] [--steps 8] [--json PATH]
                                    [--device cuda] [--gpu-memory 8GiB]

Exit code 0 when the loss went down and the run stayed within the host budget,
1 when a check fails, 2 on a bad argument (a budget no placement meets among them:
the message names the smallest that works).
"""
import argparse
import json
import sys

import torch

import hipferry
from hipferry.planner import PlanError, rss_bytes, run_steps


def build_model(hidden: int, layers: int, vocab: int, seq: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    return LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                                        num_hidden_layers=layers, num_attention_heads=heads,
                                        num_key_value_heads=heads, vocab_size=vocab,
                                        max_position_embeddings=max(64, seq)))


def pattern_batch(vocab: int, batch: int, seq: int) -> dict:
    """A short random motif repeated: a pattern the model can learn in a few steps."""
    g = torch.Generator().manual_seed(1)
    motif = torch.randint(0, vocab, (batch, 16), generator=g)
    ids = motif.repeat(1, -(-seq // 16))[:, :seq]
    return {"input_ids": ids, "labels": ids}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--host-memory", default=None, help="what the process may hold, e.g. 24GiB (default: available)")
    ap.add_argument("--state-dir", default=None, help="a folder on a disk: lets the state leave RAM")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--gpu-memory", default=None, help="on a GPU: what it may hold, e.g. 8GiB (default: free)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--json", default=None, help="write the plan and the measurements here")
    args = ap.parse_args(argv)
    for name in ("hidden", "layers", "vocab", "batch", "seq", "steps"):
        if getattr(args, name) < (2 if name == "steps" else 1):
            ap.error(f"--{name} must be >= {2 if name == 'steps' else 1}, got {getattr(args, name)}")
    if args.hidden % 64 and args.hidden > 64:
        ap.error(f"--hidden must be a multiple of 64 (heads of 64), got {args.hidden}")

    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU is visible to torch")
    model = build_model(args.hidden, args.layers, args.vocab, args.seq).to(args.device)
    batch = {k: v.to(args.device) for k, v in pattern_batch(args.vocab, args.batch, args.seq).items()}
    held = rss_bytes()
    try:
        plan = hipferry.plan(model, batch=batch, host_memory=args.host_memory, state_dir=args.state_dir,
                             gpu_memory=args.gpu_memory)
    except PlanError as e:
        print(e, file=sys.stderr)
        return 2
    except (TypeError, ValueError) as e:  # a budget that is not a size, a folder that cannot be written
        ap.error(str(e))
    applied = plan.apply(model, lr=args.lr)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    r = run_steps(model, batch, applied.optimizer, args.steps, context=applied.activations,
                  on_step=lambda i, loss, s: print(f"step {i + 1}/{args.steps}: loss {loss:.4f} ({s:.3f} s)",
                                                   flush=True))
    times, losses, how = r.step_seconds, r.losses, r.measured_by
    measured_growth, measured_step = r.peak_bytes - held, r.median_step
    c = plan.chosen
    predicted_growth = c.host_peak - held
    print(f"\nstate home: {c.label}")
    print(f"{'':22}{'predicted':>12}{'measured':>12}")
    print(f"{'peak host growth (MB)':22}{predicted_growth / 1e6:>12.1f}{measured_growth / 1e6:>12.1f}   ({how})")
    if args.device == "cuda":
        print(f"{'GPU peak (MB)':22}{c.device_peak / 1e6:>12.1f}{torch.cuda.max_memory_allocated() / 1e6:>12.1f}")
    print(f"{'step time (s)':22}{c.step_seconds:>12.3f}{measured_step:>12.3f}   (median of steps 2..{args.steps})")
    budget = plan.budgets["host_memory"]
    within = budget is None or held + measured_growth <= budget
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plan": plan.explain(as_dict=True), "losses": losses, "step_times": times,
                       "measured_growth": measured_growth, "predicted_growth": predicted_growth}, f, indent=1)
    ok = losses[-1] < losses[0] and within
    print("OK" if ok else f"FAILED: loss {losses[0]:.4f} -> {losses[-1]:.4f}, within the budget: {within}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
