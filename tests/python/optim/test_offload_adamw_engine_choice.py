"""How OffloadAdamW(step_on="auto") chooses its engine: the calibration (measured
once, cached in memory and on disk, measured again on request) and the choice
from its figures (a fast link streams the state to the GPU, a slow one keeps
the step on the CPU), plus what the optimizer reports about its choice."""
import json
import logging

import pytest
import torch

import hipferry
from hipferry.optim import calibration
from conftest import requires_gpu


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HIPFERRY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_cache", {})
    return tmp_path


def test_cpu_calibration_measures_once_and_caches_on_disk(cache_dir, monkeypatch):
    first = hipferry.optim.calibrate("cpu")
    assert first["cpu_adamw_params_per_s"] > 1e6  # even a slow core does millions per second
    assert "link_h2d_gbps" not in first           # no link without a GPU
    stored = json.loads((cache_dir / "calibration.json").read_text())
    assert list(stored.values()) == [first]

    def fail(*a, **k):
        raise AssertionError("measured again although cached")
    monkeypatch.setattr(calibration, "_cpu_adamw_params_per_s", fail)
    assert hipferry.optim.calibrate("cpu") == first      # from memory
    monkeypatch.setattr(calibration, "_cache", {})
    assert hipferry.optim.calibrate("cpu") == first      # from disk
    monkeypatch.setattr(calibration, "_cpu_adamw_params_per_s", lambda: 123.0)
    assert hipferry.optim.calibrate("cpu", refresh=True)["cpu_adamw_params_per_s"] == 123.0


def test_a_broken_cache_file_is_measured_again(cache_dir):
    (cache_dir / "calibration.json").write_text("{not json")
    assert hipferry.optim.calibrate("cpu")["cpu_adamw_params_per_s"] > 0
    json.loads((cache_dir / "calibration.json").read_text())  # rewritten as valid JSON


def test_calibrate_rejects_other_devices(cache_dir):
    with pytest.raises(ValueError, match="device must be the CPU or a GPU"):
        hipferry.optim.calibrate("meta")


def fig(link_gbps, cpu_params_per_s):
    return {"link_h2d_gbps": link_gbps, "link_d2h_gbps": link_gbps, "cpu_adamw_params_per_s": cpu_params_per_s}


def test_fast_link_streams_and_slow_link_steps_on_the_cpu():
    # H200-like: 55 GB/s each way, a CPU doing 3e9 params/s: streaming 8 B each way wins.
    choice, reason = calibration.choose_engine(fig(55, 3e9), low_precision_share=0.0, amsgrad=False)
    assert choice == "gpu" and "ns/param" in reason
    # A PCIe 3 x4 link (3 GB/s) against the same CPU: the CPU step wins.
    assert calibration.choose_engine(fig(3, 3e9), 0.0, False)[0] == "cpu"
    # A weak CPU turns it around again.
    assert calibration.choose_engine(fig(3, 1e8), 0.0, False)[0] == "gpu"


def test_more_streamed_state_moves_the_choice_towards_the_cpu():
    # Between the two: float32 params stream 8 B each way, bf16 + master and amsgrad 16 B.
    figures = fig(20, 2e9)
    assert calibration.choose_engine(figures, 0.0, False)[0] == "gpu"
    assert calibration.choose_engine(figures, 1.0, True)[0] == "cpu"


def test_8bit_state_streams_fewer_bytes_and_its_cpu_step_is_its_own():
    # 8-bit moments stream 2 x 1.016 B each way instead of 8: a link too slow for float32 state
    # streams 8-bit state, the more so as its CPU step (measured on its own) is slower.
    figures = {**fig(8, 2e9), "cpu_adamw8bit_params_per_s": 1e9}
    assert calibration.choose_engine(figures, 0.0, False)[0] == "cpu"
    choice, reason = calibration.choose_engine(figures, 0.0, False, eight_bit=True)
    assert choice == "gpu" and "1000 M params/s, 8-bit state" in reason
    # bf16 parameters: a 4 B master streams too, against 2 B of parameter sent back by the CPU engine
    assert calibration.choose_engine({**figures, "cpu_adamw8bit_params_per_s": 1e12}, 1.0, False, True)[0] == "cpu"


def test_the_8bit_cpu_step_is_measured_and_added_to_an_older_cache(cache_dir, monkeypatch):
    first = hipferry.optim.calibrate("cpu")
    assert first["cpu_adamw8bit_params_per_s"] > 1e5
    key = next(iter(json.loads((cache_dir / "calibration.json").read_text())))
    old = {k: v for k, v in first.items() if k != "cpu_adamw8bit_params_per_s"}
    (cache_dir / "calibration.json").write_text(json.dumps({key: old}))
    monkeypatch.setattr(calibration, "_cache", {})
    monkeypatch.setattr(calibration, "_cpu_adamw8bit_params_per_s", lambda: 7.0)
    assert hipferry.optim.calibrate("cpu")["cpu_adamw8bit_params_per_s"] == 7.0
    assert json.loads((cache_dir / "calibration.json").read_text())[key]["cpu_adamw8bit_params_per_s"] == 7.0


def test_cpu_parameters_report_the_cpu_engine_and_log_it(caplog):
    p = torch.nn.Parameter(torch.randn(10))
    with caplog.at_level(logging.INFO, logger="hipferry.optim"):
        opt = hipferry.optim.OffloadAdamW([p])
    assert opt.step_on == "cpu" and opt.step_on_reason == "all parameters are on the CPU"
    assert any("step_on=cpu" in r.getMessage() for r in caplog.records)


@requires_gpu
def test_gpu_parameters_auto_choice_follows_the_calibration(cache_dir, monkeypatch):
    p = torch.nn.Parameter(torch.randn(1 << 20, device="cuda"))
    monkeypatch.setattr(calibration, "calibrate", lambda device: fig(55, 3e9))
    assert hipferry.optim.OffloadAdamW([p]).step_on == "gpu"
    monkeypatch.setattr(calibration, "calibrate", lambda device: fig(1, 3e9))
    opt = hipferry.optim.OffloadAdamW([p])
    assert opt.step_on == "cpu" and "GB/s" in opt.step_on_reason


@requires_gpu
def test_gpu_calibration_measures_the_link(cache_dir):
    figures = hipferry.optim.calibrate(torch.device("cuda"))
    assert figures["link_h2d_gbps"] > 0.5 and figures["link_d2h_gbps"] > 0.5
