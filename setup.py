"""pip entry point: drives CMake (the one build description) to build hipferry._C.

    pip install --no-build-isolation .        # into the environment's torch
    pip install --no-build-isolation -e .     # editable (development)
    pip wheel --no-build-isolation --no-deps -w dist .   # a wheel (dist/hipferry-*.whl)
    python -m build --sdist --no-isolation    # a source distribution (dist/hipferry-*.tar.gz)

Environment:
    HIPFERRY_TARGET      auto (default: follow torch) | rocm | cuda | cpu
    PYTORCH_ROCM_ARCH    e.g. "gfx90a;gfx942"   (or HIPFERRY_ROCM_ARCHS)
    TORCH_CUDA_ARCH_LIST e.g. "8.0;9.0+PTX"    (or HIPFERRY_CUDA_ARCHS)
    HIPFERRY_BUILD_DIR   CMake build tree (default build/cmake-<python tag>)
    HIPFERRY_BUILD_TESTS ON to also build the C++ tests there (ctest --test-dir ...)
    HIPFERRY_TEST_HOOKS  ON to compile the test hooks into the module (default: as HIPFERRY_BUILD_TESTS)
    HIPFERRY_GTEST_SOURCE_DIR  GoogleTest sources, where no GoogleTest package is installed
    MAX_JOBS             parallel compile jobs
"""
import os
import re
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# One version, in the package (hipferry.__version__, from hipferry/version.py).
VERSION = re.search(r'^__version__ = "([^"]+)"', (ROOT / "python/hipferry/version.py").read_text(), re.M).group(1)


def default_build_dir() -> Path:
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return ROOT / "build" / f"cmake-{tag}"


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(os.environ.get("HIPFERRY_BUILD_DIR", default_build_dir()))
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DHIPFERRY_PYTHON={sys.executable}",
            f"-DHIPFERRY_OUTPUT_DIR={out_dir}",
            f"-DHIPFERRY_BUILD_TESTS={os.environ.get('HIPFERRY_BUILD_TESTS', 'OFF')}",
            f"-DHIPFERRY_TEST_HOOKS={os.environ.get('HIPFERRY_TEST_HOOKS', os.environ.get('HIPFERRY_BUILD_TESTS', 'OFF'))}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if _have("ninja"):
            args += ["-G", "Ninja"]
        for var in ("HIPFERRY_TARGET", "HIPFERRY_ROCM_ARCHS", "HIPFERRY_CUDA_ARCHS", "HIPFERRY_GTEST_SOURCE_DIR"):
            if os.environ.get(var):
                args.append(f"-D{var}={os.environ[var]}")
        subprocess.run(args, check=True)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs], check=True)


def _have(program: str) -> bool:
    from shutil import which
    return which(program) is not None


setup(
    name="hipferry",
    version=VERSION,
    description="Overlapped host<->device data movement for PyTorch on ROCm, CUDA and CPU",
    packages=find_packages("python"),
    package_dir={"": "python"},
    ext_modules=[CMakeExtension("hipferry._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    # torch without a version: installing hipferry never replaces the torch in
    # the environment (a pin would make pip swap a ROCm torch for PyPI's CUDA
    # one). Which torch releases this build runs under is checked at import,
    # from the build record (hipferry/torch_compat.py), in one sentence.
    install_requires=["torch"],
    extras_require={"bench": ["matplotlib"], "test": ["pytest", "numpy", "expecttest"]},
    zip_safe=False,
)
