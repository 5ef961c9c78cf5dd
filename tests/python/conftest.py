import gc
import os
import sys

import pytest
import torch

# Note [test folders]
# ~~~~~~~~~~~~~~~~~~~
# tests/python is grouped by capability: pool/, transfer/, optim/,
# module_offload/, abi/ and project/ (layout, docs, tools, examples, the
# public-API fuzz, the trace). Each folder holds its tests and their helpers;
# this conftest stays at the top. Tests import helpers and this file by bare
# name (`from conftest import requires_gpu`, `from disk_helpers import ...`),
# and a few cross folders (transfer_helpers in module_offload/ and project/,
# offload_adamw_helpers in project/test_trace.py, hf_model_helpers in
# optim/test_offload_adamw_overlap.py), so every folder goes on sys.path here,
# whichever file or folder pytest is given and from wherever it is run (module
# basenames are unique across the folders, as pytest's default import mode
# requires anyway). The folders are listed, not named, so a new one needs no
# edit here.
TESTS = os.path.dirname(os.path.abspath(__file__))
FOLDERS = sorted(e.name for e in os.scandir(TESTS) if e.is_dir() and not e.name.startswith(("_", ".")))
for _path in (TESTS, *(os.path.join(TESTS, f) for f in FOLDERS)):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def gpu_available() -> bool:
    import hipferry
    return torch.cuda.is_available() and hipferry.device_count() > 0


requires_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a GPU visible to torch and hipferry")


def installed_test_hooks():
    """hipferry._C._testing: hooks built into the module only with the tests
    (HIPFERRY_TEST_HOOKS); None in a production build."""
    from hipferry import _C
    return getattr(_C, "_testing", None)


requires_test_hooks = pytest.mark.skipif(installed_test_hooks() is None,
                                         reason="needs a build with the test hooks (HIPFERRY_TEST_HOOKS=ON)")


@pytest.fixture
def pool():
    """A 64 MiB pool of its own, checked and closed after the test (modules with
    other needs define their own `pool`)."""
    import hipferry
    p = hipferry.PinnedPool(capacity="64MiB")
    yield p
    gc.collect()
    p.check_invariants()
    p.close()


# Note [older-torch subset]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# The wheel built against the newest torch is also tested under each older
# torch minor it supports (scripts/dev.sh older-torch). What can differ there
# is the ABI crossing, not hipferry's arithmetic, so those runs take a subset
# (`pytest --subset older-torch`):
#   * every test of the modules about the crossing (OLDER_TORCH_MODULES, file
#     names in abi/ and pool/: each binding and op once, the tensor bridge, the
#     stable ABI, the private torch names, the build record, the error
#     translation, the fast path);
#   * every opcheck test (each op under torch's own op checker);
#   * in every other module, the tests marked `older_torch`, or else its first
#     test that is neither skipped here nor marked `slow`: each module is
#     imported and runs once (a module of slow tests only, such as the disk
#     crash test, crosses nothing the others do not, and is left out).
OLDER_TORCH_MODULES = {"test_bindings.py", "test_tensor_bridge.py", "test_stable_abi.py", "test_torch_compat.py",
                       "test_build_config.py", "test_torch_private.py", "test_pool_fast_path.py",
                       "test_error_translation.py", "test_packaging.py"}


def pytest_addoption(parser):
    parser.addoption("--subset", choices=sorted(SUBSETS), default=None,
                     help="run a subset: older-torch (Note [older-torch subset] in conftest.py) or cpu-build "
                          "(Note [cpu-build subset])")


def _skipped_here(item) -> bool:
    return any(m.args and m.args[0] is True for m in item.iter_markers("skipif")) or \
        item.get_closest_marker("skip") is not None


def older_torch_subset(items):
    """The items `--subset older-torch` keeps, in collection order."""
    marked = {item.path.name for item in items if item.get_closest_marker("older_torch")}
    keep, first_taken = [], set()
    for item in items:
        module = item.path.name
        if module in OLDER_TORCH_MODULES or "opcheck" in item.name or item.get_closest_marker("older_torch"):
            keep.append(item)
        elif module not in marked and module not in first_taken and not _skipped_here(item) and \
                not item.get_closest_marker("slow"):
            keep.append(item)
            first_taken.add(module)
    return keep


# Note [cpu-build subset]
# ~~~~~~~~~~~~~~~~~~~~~~~
# The CPU-only build (scripts/dev.sh check-cpu-build) compiles the same core and
# CPU loops as the main build; what differs is the runtime under them (no GPU
# runtime: the host memory providers, device checks, the build record). Its run
# (`pytest --subset cpu-build`) takes the older-torch subset (every binding, op
# and module once) and every test of the folders whose code calls that runtime:
# abi/, pool/ and transfer/.
CPU_BUILD_FOLDERS = {"abi", "pool", "transfer"}


def cpu_build_subset(items):
    """The items `--subset cpu-build` keeps, in collection order."""
    kept = set(map(id, older_torch_subset(items)))
    return [item for item in items if id(item) in kept or item.path.parent.name in CPU_BUILD_FOLDERS]


SUBSETS = {"older-torch": older_torch_subset, "cpu-build": cpu_build_subset}


def collected_items(config):
    """Every test this run collected, before `--subset` chose from them."""
    return config.stash[_COLLECTED]


_COLLECTED = pytest.StashKey()


def pytest_collection_modifyitems(config, items):
    config.stash[_COLLECTED] = list(items)
    subset = config.getoption("--subset")
    if subset is None:
        return
    keep = SUBSETS[subset](items)
    kept = set(map(id, keep))
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
    items[:] = keep
