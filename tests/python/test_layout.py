"""The folder layout of docs/architecture.md, checked on every include: one
include root (the repository), and each folder includes only what its row of
the table allows."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUOTED = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
ANGLED = re.compile(r'^\s*#\s*include\s+<([^>]+)>', re.M)
# folder -> project folders its quoted includes may name
ALLOWED = {
    "csrc/core": ("csrc/core/",),
    "hip": ("csrc/core/", "hip/"),
    "csrc/engine": ("csrc/core/", "csrc/engine/", "hip/"),
    "csrc/torch": ("csrc/core/", "csrc/engine/", "csrc/torch/", "hip/"),
    "csrc/testing": ("csrc/core/", "csrc/engine/", "csrc/torch/", "hip/"),
    "tests/cpp": ("csrc/core/", "csrc/engine/", "hip/", "tests/cpp/"),
}
TORCH = ("ATen/", "c10/", "torch/", "pybind11/")
VENDOR = ("hip/hip_", "cuda", "hipcub", "rocprim", "cub/")


def sources(folder):
    return sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".h", ".cpp", ".hip", ".cu"))


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_quoted_includes_name_files_from_the_repository_root_within_the_layer(folder):
    bad = []
    for path in sources(folder):
        for inc in QUOTED.findall(path.read_text()):
            if not (ROOT / inc).is_file():
                bad.append(f"{path.relative_to(ROOT)}: \"{inc}\" is not a path from the repository root")
            elif not inc.startswith(ALLOWED[folder]):
                bad.append(f"{path.relative_to(ROOT)}: \"{inc}\" is outside what {folder} may include")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("folder", ["csrc/core", "hip", "csrc/engine"])
def test_lower_layers_include_no_torch(folder):
    bad = [f"{p.relative_to(ROOT)}: <{inc}>" for p in sources(folder) for inc in ANGLED.findall(p.read_text())
           if inc.startswith(TORCH)]
    assert not bad, "\n".join(bad)


def test_vendor_headers_only_in_the_platform_switch_and_kernels():
    bad = []
    for folder in ALLOWED:
        for p in sources(folder):
            if p.suffix in (".hip", ".cu") or p.name == "platform.h":
                continue
            bad += [f"{p.relative_to(ROOT)}: <{inc}>" for inc in ANGLED.findall(p.read_text())
                    if inc.startswith(VENDOR)]
    assert not bad, "\n".join(bad)


def test_the_glue_folder_holds_no_engine_paths():
    names = {p.name for p in (ROOT / "csrc/torch").iterdir()}
    assert not names & {"transfer_paths.cpp", "transfer_paths.h", "trace_session.cpp", "trace_session.h"}


# The torch layer is on LibTorch's stable ABI (csrc/torch/stable.h): of torch's
# headers it may include only the stable ones, which one binary shares with
# every newer torch release.
STABLE_TORCH = ("torch/csrc/stable/", "torch/headeronly/")


def torch_headers_off_the_stable_abi(paths, root=ROOT):
    return [f"{p.relative_to(root)}: <{inc}>" for p in paths for inc in ANGLED.findall(p.read_text())
            if inc.startswith(("ATen/", "c10/", "torch/")) and not inc.startswith(STABLE_TORCH)]


def test_the_torch_layer_includes_only_stable_torch_headers():
    paths = sources("csrc/torch") + sources("csrc/testing")
    assert any("torch/csrc/stable/" in p.read_text() for p in paths)
    bad = torch_headers_off_the_stable_abi(paths)
    assert not bad, "\n".join(bad)


def test_the_stable_header_check_finds_aten_includes(tmp_path):
    f = tmp_path / "x.cpp"
    f.write_text("#include <torch/csrc/stable/tensor.h>\n#include <ATen/ATen.h>\n#include <c10/core/Device.h>\n")
    assert torch_headers_off_the_stable_abi([f], root=tmp_path) == ["x.cpp: <ATen/ATen.h>",
                                                                     "x.cpp: <c10/core/Device.h>"]
