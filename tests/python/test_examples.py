"""The examples run end to end (small sizes) and report bit-identical results."""
import json
import pathlib
import subprocess
import sys

import pytest

from conftest import requires_gpu

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


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


def test_convert_weights_rejects_bad_arguments():
    r = subprocess.run([sys.executable, str(EXAMPLES / "convert_weights.py"), "--width", "100"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--width" in r.stderr


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


def test_prefetch_pipeline_rejects_bad_arguments():
    r = subprocess.run([sys.executable, str(EXAMPLES / "prefetch_pipeline.py"), "--steps", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--steps must be >= 2" in r.stderr


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
def test_finetune_rejects_bad_arguments(args, named):
    r = subprocess.run([sys.executable, str(EXAMPLES / "finetune.py"), *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and named in r.stderr, r.stderr
