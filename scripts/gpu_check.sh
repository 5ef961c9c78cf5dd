#!/usr/bin/env bash
# One-command GPU check for a machine with a GPU and torch installed (no
# internet needed): builds hipferry, runs the C++ and Python GPU tests, doctor
# and the bench suites, and writes logs and JSON/PNG into OUTDIR.
#
#   scripts/gpu_check.sh OUTDIR
#
# GoogleTest: the system package, else sources in third_party/googletest (an
# ignored folder; copy Debian's /usr/src/googletest there), else C++ tests are
# skipped. Wheels in .whl/ (scripts/dev.sh gpu-wheels: expecttest for opcheck, transformers/peft for
# tests/python/module_offload/test_hf_models.py, accelerate) are installed first; without them those tests skip.
# Built for the local GPU only (TORCH_CUDA_ARCH_LIST / PYTORCH_ROCM_ARCH from
# the device) to stay well under 8 minutes on 16 cores.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD_DIR=$PWD/build/gpu-check
start=$(date +%s)
status=0
run() {  # run NAME CMD...: log to OUT/NAME.log, remember failures
  local name=$1; shift
  echo "[$(( $(date +%s) - start ))s] $name"
  if ! "$@" >"$OUT/$name.log" 2>&1; then echo "  FAILED (see $OUT/$name.log)"; status=1; fi
  tail -n 3 "$OUT/$name.log" | sed 's/^/  | /'
}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/hipferry-site .whl/*.whl
  export PYTHONPATH=/tmp/hipferry-site${PYTHONPATH:+:$PYTHONPATH}
fi
arch=$($PY -c "import torch; p = torch.cuda.get_device_properties(0); print(p.gcnArchName.split(':')[0] if torch.version.hip else f'{p.major}.{p.minor}')")
if [[ $arch == gfx* ]]; then export PYTORCH_ROCM_ARCH=$arch; else export TORCH_CUDA_ARCH_LIST=$arch; fi
gtest_src=""
[[ -f third_party/googletest/CMakeLists.txt ]] && gtest_src=$PWD/third_party/googletest
run build env HIPFERRY_BUILD_DIR="$BUILD_DIR" HIPFERRY_BUILD_TESTS=ON HIPFERRY_GTEST_SOURCE_DIR="$gtest_src" \
  $PY -m pip install --no-build-isolation --no-deps -v .
run ctest ctest --test-dir "$BUILD_DIR" --output-on-failure -LE exhaustive -j "$(nproc)"
run pytest $PY -m pytest -q -ra tests/python --junitxml="$OUT/pytest.xml"
# The HF suite's GPU cases, on their own:
run pytest_hf $PY -m pytest -q -rs tests/python/module_offload/test_hf_models.py -k cuda
run doctor $PY -m hipferry doctor
run bench $PY -m hipferry bench transfer pool copy_cast --out "$OUT/bench" --repeats 3 --max-bytes 1073741824
run bench_optim $PY -m hipferry bench optim --out "$OUT/bench_optim" --repeats 3
run bench_plan $PY -m hipferry bench plan --device cuda --out "$OUT/bench_plan"
# accelerate (the layers suite's baseline) must be importable there: put its wheel and its
# pure-Python dependencies into .whl/ when the machine has no network; else that contender is skipped.
run bench_offload $PY -m hipferry bench layers activations --out "$OUT/bench_offload" --repeats 3
run example $PY examples/convert_weights.py
run example_prefetch $PY examples/prefetch_pipeline.py --out "$OUT/prefetch"
run example_finetune $PY examples/finetune.py --json "$OUT/finetune.json" --plot "$OUT/finetune.png"
run example_offload_inference $PY examples/offload_inference.py --json "$OUT/offload_inference.json" \
  --plot "$OUT/offload_inference.png"
echo "done in $(( $(date +%s) - start ))s, status $status; results in $OUT"
exit $status
