import subprocess
import sys

import pytest

from hipferry import doctor
import hipferry


def test_doctor_runs_and_reports_ok_here():
    r = subprocess.run([sys.executable, "-m", "hipferry", "doctor", "--quick"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    target = hipferry.build_info()["target"]
    assert f"built for {target}" in r.stdout
    assert "self-test       copy_cast_ matches torch .to() bit for bit" in r.stdout
    assert "host memory     copy" in r.stdout and "GB/s" in r.stdout
    assert "pinned pool     " in r.stdout and "MiB cold in" in r.stdout
    assert "transfers       prefetch/offload round trips exact on " in r.stdout
    assert "optimizer       OffloadAdamW steps bit-identical to the CPU reference" in r.stdout
    assert "module offload  offload_layers + offload_activations outputs and gradients bit-identical" in r.stdout
    assert r.stdout.rstrip().endswith("status: OK")
    nodes = hipferry._C.numa_nodes()
    assert f"numa            {len(nodes)} node(s): {', '.join(map(str, nodes))}" in r.stdout
    for i in range(hipferry._C.device_count()):  # each device names its PCI address and node
        assert f"device {i}" in r.stdout and "NUMA node" in r.stdout


@pytest.mark.parametrize("build,flavor", [("rocm", "cuda"), ("cuda", "rocm"), ("cuda", "cpu"), ("rocm", "cpu")])
def test_diagnose_flags_a_build_torch_mismatch(build, flavor):
    problems = doctor.diagnose(build, flavor, runtime_devices=0, torch_devices=0)
    assert len(problems) == 1
    assert f"built for {build}" in problems[0] and f"{flavor} build of torch" in problems[0]


@pytest.mark.parametrize("build,flavor", [("cpu", "cpu"), ("cpu", "cuda"), ("cuda", "cuda"), ("rocm", "rocm")])
def test_diagnose_accepts_working_combinations(build, flavor):
    assert doctor.diagnose(build, flavor, runtime_devices=1 if build != "cpu" else 0,
                           torch_devices=1 if build != "cpu" else 0) == []


def test_diagnose_flags_device_count_disagreement():
    problems = doctor.diagnose("cuda", "cuda", runtime_devices=2, torch_devices=1)
    assert problems and "sees 2 device(s) but torch sees 1" in problems[0]


def test_notes_explain_cpu_only_build_under_gpu_torch():
    assert any("CPU-only build" in n for n in doctor.notes("cpu", "cuda", 0))
    assert any("no GPU device visible" in n for n in doctor.notes("cuda", "cuda", 0))


def test_device_info_rejects_bad_index():
    with pytest.raises(ValueError, match=r"device must be in \[0, "):
        hipferry.device_info(hipferry.device_count() + 3)
    with pytest.raises(TypeError, match="device must be an int"):
        hipferry.device_info("0")


def test_build_info_fields():
    b = hipferry.build_info()
    assert b["target"] in ("rocm", "cuda", "cpu")
    assert (b["architectures"] == "") == (b["target"] == "cpu")
    assert isinstance(b["cpu_f16c"], bool)


def test_optimizer_self_test_catches_a_wrong_step(monkeypatch):
    assert "bit-identical" in doctor.optimizer_self_test("cpu")
    from hipferry.optim import offload_adamw
    real = offload_adamw.group_hyper
    monkeypatch.setattr(offload_adamw, "group_hyper", lambda group: dict(real(group), eps=1e-5))  # a subtly wrong step
    with pytest.raises(RuntimeError, match="differs from the CPU reference step"):
        doctor.optimizer_self_test("cpu")


def test_module_offload_self_test_catches_a_lost_gradient(monkeypatch):
    assert "bit-identical" in doctor.module_offload_self_test("cpu")
    from hipferry.module_offload import grad_sink
    real = grad_sink.GradSink.add
    calls = []

    def drop_the_first(self, entry, grad):  # one weight gradient never reaches the host
        calls.append(entry)
        if len(calls) > 1:
            real(self, entry, grad)
    monkeypatch.setattr(grad_sink.GradSink, "add", drop_the_first)
    with pytest.raises(RuntimeError, match="gradient of .* differs"):
        doctor.module_offload_self_test("cpu")


def test_run_checks_writes_lines_and_collects_the_listed_errors():
    def broken():
        raise OSError("disk full")

    def buggy():
        raise KeyError("a bug in the doctor")
    lines = []
    checks = [doctor.Check("transfers", lambda: "fine", "transfer self-test"),
              doctor.Check("disk state", broken, "disk state self-test", (RuntimeError, OSError)),
              doctor.Check("pinned pool", lambda: "also fine", "pinned pool")]
    assert doctor.run_checks(checks, lines.append) == ["disk state self-test failed: disk full"]
    assert lines == ["  transfers       fine\n", "  pinned pool     also fine\n"]
    with pytest.raises(KeyError):  # not an error the check lists: propagates
        doctor.run_checks([doctor.Check("optimizer", buggy, "optimizer self-test")], lines.append)


def test_self_checks_keep_the_report_order():
    assert [c.label for c in doctor.self_checks(0, 0)] == [
        "self-test", "transfers", "optimizer", "module offload", "disk state", "pinned pool"]
