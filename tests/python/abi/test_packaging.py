"""The source distribution and the wheel carry what users install from."""
import email
import glob
import os
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# What CMake and setup.py build from, and what the README's commands run.
BUILD_INPUTS = ("CMakeLists.txt", "setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "requirements-dev.txt")
BUILD_FOLDERS = ("cmake/", "csrc/", "hip/", "python/", "tests/", "examples/", "scripts/")


def tracked_files():
    out = subprocess.run(["git", "-C", ROOT, "ls-files"], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return set(out.stdout.split())


@pytest.mark.slow
def test_the_sdist_carries_every_build_input_and_nothing_built(tmp_path):
    pytest.importorskip("build", reason="python -m build makes the sdist (requirements-dev.txt)")
    wanted = {f for f in tracked_files() if f in BUILD_INPUTS or f.startswith(BUILD_FOLDERS)}
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--skip-dependency-check",
                    "--outdir", str(tmp_path), ROOT], check=True, capture_output=True, cwd=ROOT)
    (sdist,) = glob.glob(str(tmp_path / "hipferry-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert not wanted - names, f"missing from the sdist: {sorted(wanted - names)[:20]}"
    built = [n for n in names if n.endswith(".so") or n == "python/hipferry/_build_config.py"
             or "/__pycache__/" in n or "/.hypothesis/" in n]
    assert not built, built


def built_wheel():
    """The wheel under test: $HIPFERRY_WHEEL, else the one scripts/dev.sh built into dist/."""
    given = os.environ.get("HIPFERRY_WHEEL")
    found = [given] if given else glob.glob(os.path.join(ROOT, "dist", "hipferry-*.whl"))
    if len(found) != 1:
        pytest.skip("no wheel built (scripts/dev.sh build makes dist/hipferry-*.whl)")
    return found[0]


def test_the_wheel_carries_the_module_and_its_build_record_and_pins_no_torch():
    with zipfile.ZipFile(built_wheel()) as whl:
        names = whl.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(whl.read(metadata))
        record = whl.read("hipferry/_build_config.py").decode()
    assert any(n.startswith("hipferry/_C") and n.endswith(".so") for n in names), names
    assert "hipferry/torch_compat.py" in names
    assert "torch_oldest = " in record and "torch_abi = " in record
    requires = meta.get_all("Requires-Dist") or []
    torch_reqs = [r for r in requires if r.split(";")[0].strip().split(" ")[0].lower() == "torch"]
    # Any installed torch satisfies it: pip never swaps the environment's torch.
    assert torch_reqs == ["torch"], requires
