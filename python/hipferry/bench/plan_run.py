"""One real run of the planner's validation (suite `plan`), in a process of its own so
that its memory is its own: build a tiny Llama from a config, plan it (the prediction
for every home), then train `steps` steps with the state in one home and measure the
peak resident growth and the step times. Prints one JSON line.

python -m hipferry.bench.plan_run '{"hidden": 512, "layers": 8, "vocab": 8192,
    "batch": 2, "seq": 128, "home": "host-8bit", "state_dir": "/tmp/x", "steps": 4}'"""
import json
import sys


def llama(hidden: int, layers: int, vocab: int, seq: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                      vocab_size=vocab, max_position_embeddings=max(seq, 64))
    return LlamaForCausalLM(cfg)


def run(spec: dict) -> dict:
    import torch

    from ..planner import plan, rss_bytes, run_steps
    device = torch.device(spec.get("device", "cpu"))
    model = llama(spec["hidden"], spec["layers"], spec["vocab"], spec["seq"]).to(device)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids.to(device), "labels": ids.to(device)}
    held = rss_bytes()
    p = plan(model, batch=batch, state_dir=spec["state_dir"], host_memory=1 << 50, disk_budget=1 << 50,
                      verbose=False)
    opt = p.apply(model, home=spec["home"], lr=1e-4).optimizer
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    r = run_steps(model, batch, opt, spec["steps"])
    device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"home": spec["home"], "params": p.profile.numel, "held_bytes": held, "peak_bytes": r.peak_bytes,
            "measured_growth": r.peak_bytes - held, "measured_by": r.measured_by,
            "device_peak_bytes": device_peak, "step_times": r.step_seconds, "losses": r.losses,
            "candidates": p.explain(as_dict=True)["candidates"], "fwd_bwd_seconds": p.profile.fwd_bwd_seconds}


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
