"""The folder layout of docs/architecture.md, checked on every include: one
include root (the repository), and each folder includes only what its row of
the table allows.

The Python package (python/hipferry) is checked on every import, module-level
and inside functions alike (built with ast):
* No circles: the import graph of the package's modules has no cycle.
* Nothing above: a folder's modules build on the folders above them, so a
  module may import modules of its own folder, its subfolders, and the plain
  modules of the folders above it (``..pool``, ``..torch_private``; in
  optim/disk: ``..checks``, ``..layout``) -- but never the front
  (``__init__.py``) of a package above its own folder (``import hipferry``,
  ``from .. import __version__``): a front imports its subpackages, so that
  is the way back up that makes circles. Another folder's modules (a sibling
  or cousin subpackage) only through its front (``hipferry.optim``, not
  ``hipferry.optim.engines``).
``_C`` and the build's ``_build_config`` are generated modules: leaves."""
import ast
import re
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parents[3]
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


# ------------------------------------------------------------------ Python imports
GENERATED = ("_C", "_build_config")  # built next to the package: leaves of the graph


def python_modules(root: Path, package: str) -> Dict[str, Path]:
    """Module name -> file for every .py file of `package` under `root`."""
    mods = {}
    for p in sorted((root / package).rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def is_front(name: str, mods: Dict[str, Path]) -> bool:
    return mods[name].name == "__init__.py"


def folder_of(name: str, mods: Dict[str, Path]) -> str:
    return name if is_front(name, mods) else name.rpartition(".")[0]


def imports_of(name: str, mods: Dict[str, Path]) -> Dict[str, int]:
    """Modules of `mods` that module `name` imports anywhere in its file -> the first line."""
    pkg = folder_of(name, mods)
    out: Dict[str, int] = {}
    for node in ast.walk(ast.parse(mods[name].read_text(), str(mods[name]))):
        if isinstance(node, ast.Import):
            named = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # `from p import x`: the module p.x where there is one, else p (x is a name p defines)
            named = [f"{module}.{a.name}" if f"{module}.{a.name}" in mods or a.name in GENERATED else module
                     for a in node.names]
        else:
            continue
        for target in named:
            while target and target not in mods and target.rpartition(".")[2] not in GENERATED:
                target = target.rpartition(".")[0]  # `import a.b.c` with c a name of a.b
            if target in mods and target != name:
                out.setdefault(target, node.lineno)
    return out


def import_graph(root: Path, package: str):
    mods = python_modules(root, package)
    return mods, {name: imports_of(name, mods) for name in mods}


def import_cycles(graph: Dict[str, Dict[str, int]]) -> List[List[str]]:
    """The modules of each cycle (strongly connected component of two or more; Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def imports_from_above(mods: Dict[str, Path], graph: Dict[str, Dict[str, int]]) -> Dict[str, str]:
    """'a -> b' -> why, for each import that breaks the "nothing above" rule (module docstring)."""
    bad = {}
    for a, targets in graph.items():
        fa = folder_of(a, mods)
        for b, line in targets.items():
            fb = folder_of(b, mods)
            if fb == fa or fb.startswith(fa + "."):
                continue  # its own folder, or below it
            if fa.startswith(fb + "."):
                if is_front(b, mods):
                    bad[f"{a} -> {b}"] = f"line {line}: the front of a package above {fa}"
            elif not is_front(b, mods):
                bad[f"{a} -> {b}"] = f"line {line}: a module of another folder, not its front ({fb})"
    return bad


def test_the_python_package_has_no_import_circles():
    _, graph = import_graph(ROOT / "python", "hipferry")
    assert "hipferry.module_offload.layers" in graph  # (the walk found the package)
    assert import_cycles(graph) == []


def test_python_modules_import_nothing_above_their_folder():
    mods, graph = import_graph(ROOT / "python", "hipferry")
    bad = imports_from_above(mods, graph)
    assert not bad, "\n".join(f"{k}: {v}" for k, v in sorted(bad.items()))


def write_package(root: Path, files: Dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_import_rules_fail_on_a_circle_and_on_an_import_from_above(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "from .sub import front_name, c\nfrom . import base\n",
        "pkg/base.py": "import os\n",
        "pkg/sub/__init__.py": "from .a import front_name\n",
        "pkg/sub/a.py": "from ..base import x\nfrom . import b\nfront_name = 1\n",
        "pkg/sub/b.py": "def later():\n    from .a import front_name  # inside a function: still an edge\n",
        "pkg/sub/c.py": "def version():\n    from .. import version  # the front above\n",
        "pkg/other/__init__.py": "",
        "pkg/other/deep.py": "from ..sub import a\nfrom .. import sub\nfrom .._C import f\n",
    })
    mods, graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.other.deep"] == {"pkg.sub.a": 1, "pkg.sub": 2}  # (_C: generated, a leaf)
    assert import_cycles(graph) == [["pkg", "pkg.sub.c"], ["pkg.sub.a", "pkg.sub.b"]]
    assert imports_from_above(mods, graph) == {
        "pkg.sub.c -> pkg": "line 2: the front of a package above pkg.sub",
        "pkg.other.deep -> pkg.sub.a": "line 1: a module of another folder, not its front (pkg.sub)"}
    # The same package without them passes both rules.
    write_package(tmp_path, {"pkg/sub/b.py": "import os\n", "pkg/sub/c.py": "from ..base import x\n",
                             "pkg/other/deep.py": "from .. import sub\n"})
    mods, graph = import_graph(tmp_path, "pkg")
    assert import_cycles(graph) == [] and imports_from_above(mods, graph) == {}
