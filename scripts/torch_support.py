"""Does the installed hipferry build run under this environment's torch?

    python scripts/torch_support.py                   exit 0 when it does, 1 (saying why) when not
    python scripts/torch_support.py --expect-refusal  exit 0 when `import hipferry` refuses this torch
                                                      in one sentence, before hipferry._C loads
    python scripts/torch_support.py --requirements-met WHEEL
                                                      exit 0 when this environment meets every requirement
                                                      of WHEEL (so pip installs nothing else with it)

Reads the build record without importing hipferry (whose import is what is checked).
"""
import importlib.metadata
import importlib.util
import os
import sys
import zipfile

import torch


def installed_module(name: str):
    spec = importlib.util.find_spec("hipferry")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        sys.exit("hipferry is not installed in this environment")
    path = os.path.join(list(spec.submodule_search_locations)[0], name + ".py")
    module_spec = importlib.util.spec_from_file_location(f"_hipferry_{name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def requirements_met(wheel: str) -> int:
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as whl:
        (name,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = whl.read(name).decode()
    unmet = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra, or another platform's
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            unmet.append(f"{req} (not installed)")
            continue
        if not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{req} (installed: {have})")
        else:
            print(f"requirement {req} met by the installed {req.name} {have}")
    for u in unmet:
        print(f"unmet requirement: {u}: pip would install something else")
    return 1 if unmet else 0


def main() -> int:
    if sys.argv[1:2] == ["--requirements-met"]:
        return requirements_met(sys.argv[2])
    compat, record = installed_module("torch_compat"), installed_module("_build_config")
    problem = compat.mismatch(record, torch.__version__, torch.version.hip, torch.version.cuda)
    if "--expect-refusal" not in sys.argv[1:]:
        print(f"torch {torch.__version__}: "
              + (problem or f"supported (this build: torch {compat.supported_range(record)})"))
        return 0 if problem is None else 1
    try:
        import hipferry  # noqa: F401
    except ImportError as e:
        message = str(e)
        ok = (message == problem and "\n" not in message and torch.__version__ in message
              and "hipferry._C" not in sys.modules)
        print(("refused at import, in one sentence: " if ok else "refused, but not as expected: ") + message)
        return 0 if ok else 1
    print(f"hipferry imported under torch {torch.__version__}, which its build record says it does not support")
    return 1


if __name__ == "__main__":
    sys.exit(main())
