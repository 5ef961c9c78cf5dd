"""One real run of the planner's validation (suite `plan`), in a process of its own so
that its memory is its own: build a tiny model from a config (a Llama, or another
family), plan it (the prediction for every home), then train `steps` steps with the
state in one home and measure the peak resident growth and the step times. Prints one
JSON line.

python -m hipferry.bench.plan_run '{"family": "llama", "hidden": 512, "layers": 8, "vocab": 8192,
    "batch": 2, "seq": 128, "home": "host-8bit", "state_dir": "/tmp/x", "steps": 4}'"""
import json
import sys


def _config(family: str, hidden: int, layers: int, vocab: int, seq: int):
    """A config of `family` at this size (heads of 64; the MLP as the family draws it)."""
    from transformers import AutoConfig
    heads = max(1, hidden // 64)
    if family == "gpt2":
        return AutoConfig.for_model("gpt2", n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab,
                                    n_positions=max(seq, 64), bos_token_id=0, eos_token_id=0)
    if family == "gpt_neox":
        return AutoConfig.for_model("gpt_neox", hidden_size=hidden, num_hidden_layers=layers,
                                    num_attention_heads=heads, intermediate_size=4 * hidden, vocab_size=vocab,
                                    max_position_embeddings=max(seq, 64), bos_token_id=0, eos_token_id=0)
    # llama, qwen2, mistral: the same names
    return AutoConfig.for_model(family, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                vocab_size=vocab, max_position_embeddings=max(seq, 64))


def build_model(family: str, hidden: int, layers: int, vocab: int, seq: int):
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(family, hidden, layers, vocab, seq))


def run(spec: dict) -> dict:
    import torch

    from ..planner import PlanError, plan, rss_bytes, run_steps
    device = torch.device(spec.get("device", "cpu"))
    model = build_model(spec.get("family", "llama"), spec["hidden"], spec["layers"], spec["vocab"],
                        spec["seq"]).to(device)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids.to(device), "labels": ids.to(device)}
    held = rss_bytes()
    # "home": one home, planned without limits; or "home": null and "host_memory": the
    # planner's own choice under that budget (for a disk home, with its window fitted).
    budget = spec.get("host_memory")
    try:
        p = plan(model, batch=batch, state_dir=spec["state_dir"], host_memory=budget or 1 << 50,
                 gpu_memory=spec.get("gpu_memory"), disk_budget=1 << 50, verbose=False)
    except PlanError as e:
        return {"home": None, "plan_error": str(e), "held_bytes": held}
    applied = p.apply(model, home=spec.get("home"), lr=1e-4)
    opt = applied.optimizer
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    r = run_steps(model, batch, opt, spec["steps"], context=applied.activations)
    device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    chosen = p.chosen if spec.get("home") is None else next(c for c in p.candidates if c.home == applied.home
                                                         and c.placement == applied.placement)
    return {"home": applied.home, "placement": chosen.label, "chosen": chosen.row(), "params": p.profile.numel,
            "pass_host_bytes": p.profile.pass_host_bytes,
            "held_bytes": held, "peak_bytes": r.peak_bytes, "measured_growth": r.peak_bytes - held,
            "measured_by": r.measured_by, "device_peak_bytes": device_peak, "step_times": r.step_seconds,
            "losses": r.losses, "candidates": p.explain(as_dict=True)["candidates"],
            "fwd_bwd_seconds": p.profile.fwd_bwd_seconds}


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
