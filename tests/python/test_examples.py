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
