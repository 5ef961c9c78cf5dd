#!/usr/bin/env bash
# hipferry developer entry point. Every subcommand works on a fresh machine.
#
#   scripts/dev.sh example   install deps, build, run examples/finetune.py (the main job: fine-tuning
#                            with OffloadAdamW vs torch.optim.AdamW)
#   scripts/dev.sh test      install deps, build, run ALL tests:
#                              ctest (core, runtime, exhaustive conversions) + pytest,
#                              AMD (ROCm Clang) and NVIDIA (nvcc) builds of the GPU code
#                              with their C++ tests (they report "no device" here),
#                              the optimizer and conversion tests again under each CPU
#                              capability of torch beyond the one it picks here
#                              (ATEN_CPU_CAPABILITY=default, avx2, avx512 where the CPU has
#                              it), with hipferry's CPU loops forced to the matching build
#                              (HIPFERRY_CPU_ISA=baseline beside torch's default kernels,
#                              avx2 beside avx2, avx512 beside avx512),
#                              the CPU-only build (laptop without a GPU toolchain)
#                              with the Python tests against it,
#                              the ASan+UBSan build of core and runtime, and the
#                              multi-threaded core tests under ThreadSanitizer,
#                              and the same wheel in a virtual environment per older torch
#                              release (HIPFERRY_OLDER_TORCH, default "2.14.1 2.13.0"), with
#                              the subset of the Python tests that crosses every binding and op
#                              (Note [older-torch subset] in tests/python/conftest.py)
#                            Each step prints its time when it ends. Compilers run through ccache
#                            (HIPFERRY_CCACHE=0: not), so the builds share objects.
#   scripts/dev.sh check     the inner loop: deps, build, lint, the C++ tests but the exhaustive ones,
#                            every Python test module once (a few minutes with a warm ccache)
#   scripts/dev.sh lint      ruff over the Python (rules in pyproject.toml) and clang-format over
#                            the C++ (.clang-format); `test` runs it first
#   scripts/dev.sh deps | build | older-torch | cpu-variants | check-gpu-builds | check-cpu-build | sanitize | tsan
#                            the single steps (older-torch needs the wheel build made in dist/)
#   scripts/dev.sh gpu-wheels  wheels of the test dependencies beyond torch (transformers, peft,
#                            accelerate, expecttest and theirs) into .whl/, for a GPU machine
#                            without network (scripts/gpu_check.sh installs them; carry .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYTAG=$($PY -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')
BUILD_DIR=${HIPFERRY_BUILD_DIR:-$PWD/build/cmake-$PYTAG}
JOBS=${MAX_JOBS:-$(nproc)}
# A step prints how long the one before it took as it starts; step_end closes
# the last one. `test` ends with the total and each step's time again.
STEP_NAME="" STEP_START=0 STEP_TIMES=()
step_end() {
  if [[ -n $STEP_NAME ]]; then
    local took=$(( $(date +%s) - STEP_START ))
    printf -- '--- %4d s  %s\n' "$took" "$STEP_NAME"
    STEP_TIMES+=("$(printf '%5d s  %s' "$took" "$STEP_NAME")")
  fi
  STEP_NAME=""
}
step() { step_end; STEP_NAME="$*" STEP_START=$(date +%s); printf '\n=== %s ===\n' "$*"; }
# Compilers run through ccache (installed by deps): the trees below compile the
# same core and kernels, and a later run recompiles only what changed, from
# any clone (paths under the checkout are hashed relative to it). CMake reads
# the launcher variables as the launchers' defaults.
use_ccache() {
  if [[ ${HIPFERRY_CCACHE:-1} != 0 ]] && command -v ccache >/dev/null; then
    export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache
    export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true
  fi
}
# Drops pip's root warning; the pipeline keeps pip's exit status (pipefail).
quiet_pip() { "$@" 2>&1 | { grep -v "Running pip as the 'root' user" || true; }; }

deps() {
  step "system packages"
  local pkgs=(cmake ninja-build googletest libgtest-dev hipcc librocprim-dev ccache liburing-dev fio clang-format)
  local missing=()
  for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if ((${#missing[@]})); then
    if [[ $(id -u) -eq 0 ]]; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
      echo "missing Debian packages: ${missing[*]} (run as root or: sudo apt-get install ${missing[*]})" >&2
      exit 1
    fi
  fi
  step "python packages"
  quiet_pip $PY -m pip install -q -r requirements-dev.txt
  quiet_pip $PY -m pip install -q --no-deps -r requirements-nodeps.txt  # (its header says why)
}

# One wheel, built once (dist/), is what every environment below installs.
build_wheel() {
  step "build the hipferry wheel (CMake tree: $BUILD_DIR)"
  # A hipferry already installed would satisfy the older-torch environments'
  # install (they see this site-packages): the wheel goes in after them.
  quiet_pip $PY -m pip uninstall -y -q hipferry
  rm -f dist/hipferry-*.whl
  HIPFERRY_BUILD_DIR="$BUILD_DIR" HIPFERRY_BUILD_TESTS=ON MAX_JOBS=$JOBS \
    quiet_pip $PY -m pip wheel --no-build-isolation --no-deps -q -w dist .
  sha256sum dist/hipferry-*.whl
}

install_wheel() {
  step "install the wheel into this environment"
  quiet_pip $PY -m pip install --no-deps --force-reinstall -q dist/hipferry-*.whl
  $PY -c "import hipferry; print('installed hipferry', hipferry.__version__, hipferry.build_info())"
}

build() { build_wheel; install_wheel; }

# The same wheel in a second virtual environment per older torch release. The
# torch wheels (about 500 MiB each) are kept in a cache the next run reuses.
OLDER_TORCH=${HIPFERRY_OLDER_TORCH:-2.14.1 2.13.0}
# Under an older torch what can differ is the crossing between Python, torch
# and the module: the subset of Note [older-torch subset] (each binding and
# op, every opcheck, the bridge and ABI modules, one test of every other module).
OLDER_TORCH_TESTS=(--subset older-torch tests/python)
TORCH_WHEEL_CACHE=${HIPFERRY_TORCH_WHEEL_CACHE:-$HOME/.cache/hipferry-ci/torch-wheels}
older_torch() {
  local wheel
  wheel=$(ls dist/hipferry-*.whl)
  for v in $OLDER_TORCH; do
    step "the same wheel ($(basename "$wheel")) under torch $v, in a virtual environment of its own"
    local cached
    cached=$(ls "$TORCH_WHEEL_CACHE"/torch-"$v"-"$PYTAG"-*.whl 2>/dev/null | head -1 || true)
    if [[ -z $cached ]]; then
      mkdir -p "$TORCH_WHEEL_CACHE"
      echo "downloading torch $v into $TORCH_WHEEL_CACHE (once)"
      quiet_pip $PY -m pip download -q --no-deps --only-binary=:all: "torch==$v" -d "$TORCH_WHEEL_CACHE"
      cached=$(ls "$TORCH_WHEEL_CACHE"/torch-"$v"-"$PYTAG"-*.whl | head -1)
    fi
    # The venv sees this environment's packages (the test tools, the CUDA
    # libraries torch loads); its own torch comes first on sys.path.
    local venv=build/venv-torch-$v
    rm -rf "$venv"
    $PY -m venv --system-site-packages "$venv"
    quiet_pip "$venv/bin/python" -m pip install -q --no-deps --no-index "$cached"
    # torch loads its CUDA libraries from site-packages/nvidia next to itself
    # (the older torch's libcufile is not found through sys.path otherwise).
    local site
    site=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    [[ -d $site/nvidia ]] && ln -sfn "$site/nvidia" "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia"
    "$venv/bin/python" -c "import torch; assert torch.__version__.startswith('$v'), torch.__version__"
    # pip installs a wheel's dependencies only where what is installed does
    # not satisfy them: every requirement met here means no other torch is pulled.
    "$venv/bin/python" scripts/torch_support.py --requirements-met "$wheel"
    quiet_pip "$venv/bin/python" -m pip install -q --no-deps --no-index "$wheel"
    if "$venv/bin/python" scripts/torch_support.py; then
      "$venv/bin/python" -m pytest -q -p no:cacheprovider "${OLDER_TORCH_TESTS[@]}"
    else
      "$venv/bin/python" scripts/torch_support.py --expect-refusal
    fi
  done
}

# Machines of this kind differ (AVX-512 on some, AVX2 only on others) and torch
# picks other CPU kernels on each, so the tests whose oracle is torch's CPU
# arithmetic run again under each capability torch can take here, beyond the
# one it takes by itself (the main run has that one), and with hipferry's own
# loops forced to their baseline build. The baseline build goes with torch's
# `default` kernels in one run: hipferry's two builds give the same bits (a
# test of the main run says so), so pairing each of them with every torch
# capability would test nothing more.
CPU_VARIANT_TESTS=(tests/python/optim/test_adamw_step.py tests/python/transfer/test_copy_cast.py
                   tests/python/optim/test_offload_adamw.py tests/python/optim/test_offload_adamw_state.py
                   tests/python/optim/test_offload_adamw_errors.py tests/python/optim/test_offload_adamw_grad_copies.py
                   tests/python/optim/test_offload_adamw_torch_parity.py tests/python/optim/test_offload_adamw_fuzz.py
                   tests/python/module_offload/test_hf_models.py)  # (Trainer + OffloadAdamW against torch's AdamW)
cpu_variants() {
  local caps=(default avx2)
  grep -qw avx512f /proc/cpuinfo && caps+=(avx512)
  local own best
  own=$($PY -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())")
  best=$($PY -c "import hipferry; print(hipferry.build_info()['cpu_isa_best'])")
  local files=()
  for f in "${CPU_VARIANT_TESTS[@]}"; do [[ -e $f ]] && files+=("$f"); done
  for cap in "${caps[@]}"; do
    if [[ $cap == "$own" && $cap != default ]]; then
      echo "torch takes $cap by itself here: the main run tested it"
      continue
    fi
    # hipferry's loops of the same width as torch's kernels (an AVX2 machine: avx2 beside avx2).
    local isa=$cap
    [[ $cap == default ]] && isa=baseline
    [[ $cap == avx512 && $best != avx512 ]] && isa=auto  # (AVX-512 F without BW / VL: hipferry's best is avx2)
    step "optimizer and conversion tests under ATEN_CPU_CAPABILITY=$cap, HIPFERRY_CPU_ISA=$isa"
    ATEN_CPU_CAPABILITY=$cap HIPFERRY_CPU_ISA=$isa $PY -c "import torch, hipferry; c = torch.backends.cpu.get_cpu_capability(); \
assert c.lower() == '$cap', f'asked for $cap, torch uses {c}'; \
assert '$isa' == 'auto' or hipferry.build_info()['cpu_isa'] == '$isa', hipferry.build_info(); \
print('torch CPU capability:', c, '| hipferry CPU loops:', hipferry.build_info()['cpu_isa'])"
    ATEN_CPU_CAPABILITY=$cap HIPFERRY_CPU_ISA=$isa $PY -m pytest -q -p no:cacheprovider "${files[@]}"
  done
}

# GPU code for both vendors, without torch: compile, link, run the C++ tests.
check_gpu_builds() {
  step "AMD build (ROCm Clang, gfx90a;gfx940;gfx1030)"
  cmake -S . -B build/check-rocm -G Ninja -DHIPFERRY_BUILD_TORCH=OFF -DHIPFERRY_TARGET=rocm \
    -DHIPFERRY_ROCM_ARCHS="gfx90a;gfx940;gfx1030" >/dev/null
  cmake --build build/check-rocm -j "$JOBS"
  ctest --test-dir build/check-rocm --output-on-failure -LE exhaustive -j "$JOBS"
  step "NVIDIA build (nvcc, sm_80 sm_90)"
  cmake -S . -B build/check-cuda -G Ninja -DHIPFERRY_BUILD_TORCH=OFF -DHIPFERRY_TARGET=cuda \
    -DHIPFERRY_CUDA_ARCHS="80-real;90" >/dev/null
  cmake --build build/check-cuda -j "$JOBS"
  ctest --test-dir build/check-cuda --output-on-failure -LE exhaustive -j "$JOBS"
}

# The CPU-only extension (HIPFERRY_TARGET=cpu: a laptop's torch without a GPU
# toolchain), installed into a folder of its own and tested with pytest: the
# tests of what differs there (Note [cpu-build subset] in tests/python/conftest.py).
check_cpu_build() {
  step "CPU-only build of the torch extension, and the Python tests against it"
  HIPFERRY_TARGET=cpu HIPFERRY_BUILD_DIR="$PWD/build/check-cpu-torch" HIPFERRY_BUILD_TESTS=OFF HIPFERRY_TEST_HOOKS=ON MAX_JOBS=$JOBS \
    quiet_pip $PY -m pip install --no-build-isolation --no-deps -q --upgrade --target build/check-cpu-site .
  PYTHONPATH="$PWD/build/check-cpu-site" $PY -c \
    "import hipferry; b = hipferry.build_info(); assert b['target'] == 'cpu', b; print('CPU-only build:', b)"
  PYTHONPATH="$PWD/build/check-cpu-site" $PY -m pytest -q -ra -p no:cacheprovider --subset cpu-build tests/python
}

sanitize() {
  step "ASan + UBSan build of core and CPU runtime"
  cmake -S . -B build/check-asan -G Ninja -DHIPFERRY_BUILD_TORCH=OFF -DHIPFERRY_TARGET=cpu \
    -DHIPFERRY_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build/check-asan -j "$JOBS"
  ctest --test-dir build/check-asan --output-on-failure -LE exhaustive -j "$JOBS"
}

tsan() {
  step "ThreadSanitizer build: the multi-threaded core tests (pinned pool, serial worker, trace recorder, copy scheduler, disk I/O backends)"
  cmake -S . -B build/check-tsan -G Ninja -DHIPFERRY_BUILD_TORCH=OFF -DHIPFERRY_TARGET=cpu \
    -DHIPFERRY_TSAN=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build/check-tsan -j "$JOBS" --target hipferry_core_tests
  TSAN_OPTIONS=halt_on_error=1 build/check-tsan/tests/cpp/hipferry_core_tests --gtest_filter='HostPool*:SerialWorker*:TraceRecorder*:SlotRing*:InFlightWindow*:Schedule*:WorkerStream*:AdamWPipeline*:ReleaseList*:Backends/RealBackend*:MakeBackend*'
}

lint() {
  step "lint: ruff over python/, tests/, examples/, scripts/ (the rules: pyproject.toml [tool.ruff])"
  $PY -m ruff check python tests examples scripts
  step "lint: clang-format over the tracked C++ and HIP files (the style: .clang-format)"
  git ls-files -z '*.cpp' '*.h' '*.hip' | xargs -0 clang-format --dry-run --Werror
}

# The inner loop (a few minutes with a warm ccache): build, the C++ tests but the exhaustive
# ones, and every Python test module once (each binding, op and opcheck, and one test of
# every other module: Note [older-torch subset]); run the modules you touched in full
# beside it. `test` stays the whole matrix (the whole Python suite took 20 min here).
check() {
  deps; use_ccache; build; lint
  step "C++ tests of the installed build, but the exhaustive ones"
  ctest --test-dir "$BUILD_DIR" --output-on-failure -LE exhaustive -j "$JOBS"
  step "Python: every module once (--subset older-torch)"
  $PY -m pytest -q -ra -p no:cacheprovider --subset older-torch tests/python
}

run_tests() {
  step "C++ tests of the installed build ($BUILD_DIR)"
  ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS"
  step "Python tests"
  $PY -m pytest -q -ra --durations=25 tests/python
}

use_ccache
case "${1:-}" in
  deps) deps ;;
  build) build ;;
  older-torch) older_torch ;;
  cpu-variants) cpu_variants ;;
  check-gpu-builds) check_gpu_builds ;;
  check-cpu-build) check_cpu_build ;;
  sanitize) sanitize ;;
  tsan) tsan ;;
  lint) lint ;;
  check) check; step_end ;;
  gpu-wheels)
    mkdir -p .whl
    # shellcheck disable=SC2046  # one word per distribution
    $PY -m pip download -q --no-deps -d .whl $($PY scripts/offline_wheels.py)
    ls .whl
    ;;
  test)
    start=$(date +%s)
    deps; lint; use_ccache; build_wheel; older_torch; install_wheel; run_tests; cpu_variants; check_gpu_builds; check_cpu_build; sanitize; tsan
    step_end
    printf '\n=== all tests passed in %d s ===\n' "$(( $(date +%s) - start ))"
    printf '%s\n' "${STEP_TIMES[@]}"
    ;;
  example)
    deps; use_ccache; build
    step "examples/finetune.py (OffloadAdamW vs torch.optim.AdamW)"
    $PY examples/finetune.py
    step_end
    ;;
  *) sed -n '2,/^set -euo/{/^set -euo/!p}' "$0"; exit 2 ;;
esac
