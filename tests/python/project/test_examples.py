"""The examples run end to end (small sizes) and report bit-identical results."""
import json
import os
import pathlib
import re
import runpy
import subprocess
import sys

import pytest

from conftest import requires_gpu

EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples"


def run_rejected(script, args, capsys):
    """(exit status, stderr) of examples/`script` run with `args` as a script, in this process: a
    rejected argument stops it before any work, so no interpreter and torch import per case."""
    argv, path, modules = sys.argv, list(sys.path), set(sys.modules)
    sys.argv = [str(EXAMPLES / script), *args]
    sys.path.insert(0, str(EXAMPLES))  # as for a script: its folder first (examples import each other)
    try:
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv, sys.path[:] = argv, path
        for name in set(sys.modules) - modules:  # the examples' own modules, not the libraries they loaded
            if getattr(sys.modules[name], "__file__", None) and str(EXAMPLES) in sys.modules[name].__file__:
                del sys.modules[name]
    return code, capsys.readouterr().err


def test_run_rejected_sees_the_status_of_a_script(tmp_path, capsys):
    # The helper can fail: a script that exits 0, and one whose error is not argparse's.
    global EXAMPLES
    (tmp_path / "ok.py").write_text("print('ran')\n")
    (tmp_path / "bad.py").write_text("import sys\nsys.stderr.write('no --x\\n')\nsys.exit(2)\n")
    saved, EXAMPLES = EXAMPLES, tmp_path
    try:
        assert run_rejected("ok.py", [], capsys) == (0, "")
        assert run_rejected("bad.py", ["--x"], capsys) == (2, "no --x\n")
    finally:
        EXAMPLES = saved


def _run_convert_weights(device):
    r = subprocess.run([sys.executable, str(EXAMPLES / "convert_weights.py"), "--layers", "1", "--width", "64",
                        "--device", device], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bit-identical to torch" in r.stdout
    assert "ratio torch/hipferry" in r.stdout
    return r.stdout


def test_convert_weights_on_cpu():
    _run_convert_weights("cpu")


@requires_gpu
def test_convert_weights_on_gpu_reads_from_the_pinned_pool():
    out = _run_convert_weights("cuda")
    assert "pinned pool (" in out and "MiB reserved" in out


def test_convert_weights_rejects_bad_arguments(capsys):
    code, err = run_rejected("convert_weights.py", ["--width", "100"], capsys)
    assert code == 2 and "--width" in err


def _run_prefetch_pipeline(device, tmp_path):
    r = subprocess.run([sys.executable, str(EXAMPLES / "prefetch_pipeline.py"), "--steps", "3", "--batch", "8",
                        "--width", "64", "--layers", "1", "--device", device, "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "outputs bit-identical between the two loops: True" in r.stdout
    assert "[traced run] batch 3/3" in r.stderr  # progress
    trace = json.loads((tmp_path / "prefetch_pipeline.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"compute batch 0", "compute batch 2"} <= names
    return r.stdout


def test_prefetch_pipeline_on_cpu(tmp_path):
    _run_prefetch_pipeline("cpu", tmp_path)


@requires_gpu
def test_prefetch_pipeline_on_gpu(tmp_path):
    out = _run_prefetch_pipeline("cuda", tmp_path)
    assert "copies/kernels" in out


def test_prefetch_pipeline_rejects_bad_arguments(capsys):
    code, err = run_rejected("prefetch_pipeline.py", ["--steps", "1"], capsys)
    assert code == 2 and "--steps must be >= 2" in err


def _run_finetune(tmp_path, *extra, device="cpu"):
    out_json = tmp_path / "finetune.json"
    r = subprocess.run([sys.executable, str(EXAMPLES / "finetune.py"), "--layers", "1", "--width", "64",
                        "--heads", "2", "--seq", "32", "--batch", "2", "--steps", "6", "--device", device,
                        "--json", str(out_json), *extra], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[OffloadAdamW] step    6/6" in r.stdout and "[torch AdamW] step    6/6" in r.stdout  # progress
    assert "step time (median)" in r.stdout and "loss went down" in r.stdout
    s = json.loads(out_json.read_text())
    assert s["device"] == device and s["ok"] is True and s["params"] > 0
    h, t = s["runs"]["hipferry"], s["runs"]["torch"]
    for run in (h, t):
        assert len(run["losses"]) == len(run["lrs"]) == len(run["step_ms"]) == 6
        assert run["losses"][-1] < run["losses"][0] and run["median_step_ms"] > 0 and run["rss_bytes"] > 0
    assert h["losses"][0] == t["losses"][0]  # same initial weights and data
    assert h["lrs"] == t["lrs"]  # the same schedule drove both
    assert s["step_on"] in ("cpu", "gpu") and s["step_on_reason"]
    # The state both optimizers hold is exp_avg and exp_avg_sq in float32, 8 bytes per parameter.
    n_state = 8 * s["params"]
    if "disk_window_bytes" not in h:  # (--state-dir: the host holds the window)
        assert h["host_state_bytes"] + h["device_state_bytes"] == n_state
    return r.stdout, s


def test_finetune_on_cpu(tmp_path):
    out, s = _run_finetune(tmp_path, "--plot", str(tmp_path / "loss.png"))
    assert "losses agree with torch.optim.AdamW" in out
    assert s["dtype"] == "float32" and s["step_on"] == "cpu" and s["max_rel_loss_diff"] < 1e-3
    assert "n/a (CPU)" in out and s["runs"]["hipferry"]["device_peak_bytes"] is None
    h, t = s["runs"]["hipferry"], s["runs"]["torch"]
    assert h["host_state_bytes"] == t["host_state_bytes"] == 8 * s["params"]  # CPU parameters: all on the host
    import importlib.util
    if importlib.util.find_spec("matplotlib"):  # else the script says it wrote no plot
        assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_finetune_with_the_state_on_disk(tmp_path):
    """--state-dir: the same losses as torch.optim.AdamW (exact AdamW), the state in files."""
    out, s = _run_finetune(tmp_path, "--state-dir", str(tmp_path / "state"))
    assert "losses agree with torch.optim.AdamW" in out and "optimizer state on disk" in out
    h = s["runs"]["hipferry"]
    assert s["max_rel_loss_diff"] < 1e-3 and h["disk_steps"] == s["config"]["steps"]
    assert h["host_state_bytes"] == h["disk_window_bytes"] and h["disk_bytes_written_per_step"] >= 12 * s["params"]


def test_finetune_parity_report_for_8bit_state(tmp_path):
    """The 8-bit state's loss curve against float32 state's over the whole run (issue 31's parity report)."""
    out, s = _run_finetune(tmp_path, "--parity-8bit", "--width", "128", "--steps", "6",
                           "--plot", str(tmp_path / "loss.png"))
    assert "[OffloadAdamW 8-bit] step    6/6" in out and "8-bit state parity" in out
    q, h = s["runs"]["hipferry_8bit"], s["runs"]["hipferry"]
    assert len(q["losses"]) == 6 and q["state_format"] == "uint8" and h["state_format"] == "float32"
    assert q["losses"][0] == h["losses"][0]
    assert s["parity_8bit"]["max_rel_loss_gap"] <= 0.01
    assert q["host_state_bytes"] < h["host_state_bytes"] / 2


@requires_gpu
@pytest.mark.parametrize("step_on", ["cpu", "gpu"])
def test_finetune_on_gpu(tmp_path, step_on):
    # Width 256: the MLP matrices (256 x 1024) are above min_offload_numel, so their state goes to the host.
    out, s = _run_finetune(tmp_path, "--width", "256", "--dtype", "float32", "--step-on", step_on, device="cuda")
    assert "losses agree with torch.optim.AdamW" in out and s["max_rel_loss_diff"] < 1e-3
    assert s["step_on"] == step_on
    h, t = s["runs"]["hipferry"], s["runs"]["torch"]
    assert h["device_peak_bytes"] > 0 and t["device_peak_bytes"] > 0
    assert h["host_state_bytes"] > 0 and t["host_state_bytes"] == 0  # torch keeps all of its state on the device
    assert h["device_state_bytes"] < t["device_state_bytes"]


@requires_gpu
def test_finetune_on_gpu_in_bfloat16_keeps_a_float32_master(tmp_path):
    r = subprocess.run([sys.executable, str(EXAMPLES / "finetune.py"), "--layers", "1", "--width", "256",
                        "--heads", "2", "--seq", "32", "--batch", "2", "--steps", "6", "--device", "cuda",
                        "--json", str(tmp_path / "s.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bfloat16: OffloadAdamW keeps a float32 master copy" in r.stdout
    s = json.loads((tmp_path / "s.json").read_text())
    h = s["runs"]["hipferry"]
    assert s["dtype"] == "bfloat16"
    assert h["host_state_bytes"] + h["device_state_bytes"] == 12 * s["params"]  # exp_avg, exp_avg_sq, master


@pytest.mark.parametrize("args, named", [(["--width", "100", "--heads", "3"], "--width"),
                                         (["--steps", "1"], "--steps"),
                                         (["--device", "cpu", "--step-on", "gpu"], "--step-on"),
                                         (["--seq", "100000"], "--seq")])
def test_finetune_rejects_bad_arguments(args, named, capsys):
    code, err = run_rejected("finetune.py", args, capsys)
    assert code == 2 and named in err, err


def _run_offload_inference(tmp_path, *extra, device="cpu"):
    out_json = tmp_path / "offload_inference.json"
    r = subprocess.run([sys.executable, str(EXAMPLES / "offload_inference.py"), "--layers", "4", "--width", "64",
                        "--heads", "2", "--tokens", "8", "--train-steps", "5", "--device", device,
                        "--json", str(out_json), *extra], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[warm-up training] step    5/5" in r.stdout and "[offloaded] token    8/8" in r.stdout  # progress
    assert "offloaded / reference speed" in r.stdout and "outputs equal the reference's" in r.stdout
    s = json.loads(out_json.read_text())
    assert s["device"] == device and s["ok"] is True and s["checks"]["undo_outputs_equal"] is True
    assert s["device_model_bytes"] == s["ring_bytes"] + s["resident_bytes"] <= s["budget_bytes"]
    assert s["device_model_bytes"] < s["weight_bytes"]  # 3 of 4 blocks' weights and the rest of the model
    st = s["offload_stats"]
    assert st["blocks"] == 4 and st["ring_slots"] == 3 and st["device_bytes"] == s["ring_bytes"]
    assert st["hits"] > 0 and st["hits"] + st["stalls"] + st["reused"] == 4 * 8  # a use per block and token
    for run in (s["offloaded"], s["reference"]):
        assert len(run["tokens"]) == len(run["latency_ms"]) == 8 and run["tokens_per_s"] > 0
    assert len(s["train_losses"]) == 5 and s["speed_ratio"] > 0
    return r.stdout, s


def test_offload_inference_on_cpu(tmp_path):
    out, s = _run_offload_inference(tmp_path, "--plot", str(tmp_path / "tokens.png"),
                                    "--trace", str(tmp_path / "trace"))
    assert "generated tokens identical to the reference's" in out
    # The trace shows every block's forward and the ring's copies of those tokens (LayerCopier's spans).
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = [e["name"] for e in events]
    assert sum(n.startswith("blocks.") for n in names) == 3 * 4 and "layer copy" in names, sorted(set(names))
    assert s["checks"]["tokens_identical"] is True and s["tokens_identical"] is True
    assert s["offloaded"]["tokens"] == s["reference"]["tokens"] and s["first_logits_max_diff"] == 0
    assert s["offloaded"]["device_peak_bytes"] is None and s["reference_device"] == "cpu"
    assert s["weight_bytes"] <= s["host_bytes"] + s["resident_bytes"]  # blocks on the host (padded), the rest not
    import importlib.util
    if importlib.util.find_spec("matplotlib"):  # else the script says it wrote no plot
        assert (tmp_path / "tokens.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_offload_inference_with_bfloat16_host_weights_reports_but_does_not_require_identical_tokens(tmp_path):
    out, s = _run_offload_inference(tmp_path, "--host-dtype", "bfloat16")
    assert "not required with --host-dtype bfloat16" in out and "tokens_identical" not in s["checks"]
    assert s["host_dtype"] == "bfloat16" and s["host_bytes"] * 2 < s["weight_bytes"]  # half the block bytes


@requires_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offload_inference_on_gpu(tmp_path, dtype):
    # 8 blocks of width 256: the ring (3 slots) is well below the weights, so the peaks differ clearly.
    out, s = _run_offload_inference(tmp_path, "--layers", "8", "--width", "256", "--dtype", dtype, device="cuda")
    assert "torch.cuda.max_memory_allocated" in out and s["reference_device"] == "cuda"
    if dtype == "float32":
        assert s["checks"]["tokens_identical"] is True
    off, ref = s["offloaded"]["device_peak_bytes"], s["reference"]["device_peak_bytes"]
    assert s["ring_bytes"] <= off < ref


def test_offload_inference_budget_too_small_names_the_budget_that_works(tmp_path):
    cmd = [sys.executable, str(EXAMPLES / "offload_inference.py"), "--layers", "4", "--width", "64", "--heads", "2",
           "--tokens", "4", "--train-steps", "2", "--device", "cpu"]
    r = subprocess.run(cmd + ["--budget", "1KiB"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--budget 1 KiB is too small for --prefetch 2" in r.stderr, r.stdout + r.stderr
    assert "[warm-up training]" not in r.stdout  # checked before training
    enough = r.stderr.split("pass --budget ")[1].split()[0]
    r = subprocess.run(cmd + ["--budget", enough, "--json", str(tmp_path / "s.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["device_model_bytes"] <= s["budget_bytes"] < s["device_model_bytes"] + 1024


@pytest.mark.parametrize("args, named", [(["--width", "100", "--heads", "3"], "--width"),
                                         (["--layers", "1"], "--layers"),
                                         (["--budget", "lots"], "--budget"),
                                         (["--prefetch", "-1"], "--prefetch"),
                                         (["--tokens", "0"], "--tokens"),
                                         (["--dtype", "float16"], "--dtype")])
def test_offload_inference_rejects_bad_arguments(args, named, capsys):
    code, err = run_rejected("offload_inference.py", ["--device", "cpu", *args], capsys)
    assert code == 2 and named in err, err


def _run_hf_finetune_offload(tmp_path, *extra, device="cpu"):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    out_json = tmp_path / "hf_finetune_offload.json"
    r = subprocess.run([sys.executable, str(EXAMPLES / "hf_finetune_offload.py"), "--steps", "3", "--layers", "3",
                        "--hidden", "32", "--seq", "16", "--batch", "2", "--device", device, "--json", str(out_json),
                        *extra], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[step    3/3] loss" in r.stdout and "what moved (handle.stats())" in r.stdout  # progress, stats
    s = json.loads(out_json.read_text())
    assert s["device"] == device and s["ok"] is True and len(s["losses"]) == 3
    assert s["block_names"] == [f"base_model.model.model.layers.{i}" for i in range(3)]  # found under peft
    assert 0 < s["trainable_params"] < s["params"]  # LoRA only
    st = s["stats"]
    assert st["blocks"] == 3 and st["bytes_moved"] > 0 and st["grad_bytes_moved"] > 0  # weights in, LoRA grads out
    return r.stdout, s


def test_hf_finetune_offload_on_cpu(tmp_path):
    _run_hf_finetune_offload(tmp_path)


def test_hf_finetune_offload_with_gradient_checkpointing_on_cpu(tmp_path):
    _run_hf_finetune_offload(tmp_path, "--gradient-checkpointing")


@requires_gpu
def test_hf_finetune_offload_on_gpu(tmp_path):
    out, s = _run_hf_finetune_offload(tmp_path, device="cuda")
    assert "on cuda" in out


@pytest.mark.parametrize("args, named", [(["--steps", "0"], "--steps"), (["--hidden", "30"], "--hidden"),
                                         (["--layers", "1"], "--layers"), (["--seq", "100000"], "--seq")])
def test_hf_finetune_offload_rejects_bad_arguments(args, named, capsys):
    code, err = run_rejected("hf_finetune_offload.py", ["--device", "cpu", *args], capsys)
    assert code == 2 and named in err, err


FIT_ARGS = ["--hidden", "64", "--layers", "2", "--vocab", "256", "--seq", "32", "--steps", "4"]


def _run_fit(tmp_path, *args):
    env = dict(os.environ, HIPFERRY_CACHE_DIR=str(tmp_path.parent / "fit-cache"))  # (the machine measured once)
    return subprocess.run([sys.executable, str(EXAMPLES / "fit_finetune.py"), *FIT_ARGS, *args], capture_output=True,
                          text=True, timeout=600, env=env)


def test_fit_finetune_plans_trains_and_reports_prediction_beside_measurement(tmp_path):
    r = _run_fit(tmp_path, "--host-memory", "64GiB", "--json", str(tmp_path / "fit.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "->torch" in r.stderr and "chosen: nothing needs offloading" in r.stderr  # everything fits
    assert "peak host growth (MB)" in r.stdout and "step time (s)" in r.stdout and "OK" in r.stdout
    s = json.loads((tmp_path / "fit.json").read_text())
    assert s["plan"]["chosen"] == "torch" and s["losses"][-1] < s["losses"][0]


def test_fit_finetune_with_a_budget_only_the_disk_meets(tmp_path):
    first = _run_fit(tmp_path, "--host-memory", "1000", "--state-dir", str(tmp_path / "a"))
    m = re.search(r"The smallest host_memory that works is ([0-9.]+) GB, with the state in (\S+)", first.stderr)
    assert first.returncode == 2 and m, first.stderr[-3000:]
    assert not os.listdir(tmp_path / "a"), "nothing was written before the refusal"
    budget = f"{float(m.group(1)) + 0.05:.3f}GB"  # (the process's own RSS moves between runs)
    r = _run_fit(tmp_path, "--host-memory", budget, "--state-dir", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"state home: \S+", r.stdout)


@pytest.mark.parametrize("args, named", [(["--host-memory", "lots"], "host_memory"),
                                         (["--steps", "1"], "--steps"), (["--hidden", "100"], "--hidden")])
def test_fit_finetune_rejects_bad_arguments(args, named, capsys):
    code, err = run_rejected("fit_finetune.py", args, capsys)
    assert code == 2 and named in err
