"""The examples run end to end (small sizes) and report bit-identical results."""
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
