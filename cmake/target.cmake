# Resolves HIPFERRY_TARGET (rocm | cuda | cpu | auto) before project(), because
# the ROCm build needs hipcc as its C++ compiler.
#
# auto follows the installed torch (torch.version.hip -> rocm, torch.version.cuda
# -> cuda, neither -> cpu); without torch (HIPFERRY_BUILD_TORCH=OFF) auto is cpu.
# An explicit target that contradicts torch fails here, with what to do.

set(HIPFERRY_TARGET "$ENV{HIPFERRY_TARGET}" CACHE STRING "rocm, cuda, cpu or auto")
if(HIPFERRY_TARGET STREQUAL "")
  set(HIPFERRY_TARGET "auto" CACHE STRING "rocm, cuda, cpu or auto" FORCE)
endif()
if(NOT HIPFERRY_TARGET MATCHES "^(auto|rocm|cuda|cpu)$")
  message(FATAL_ERROR "HIPFERRY_TARGET='${HIPFERRY_TARGET}': expected one of auto, rocm, cuda, cpu.")
endif()

set(HIPFERRY_TORCH_FLAVOR "")
if(HIPFERRY_BUILD_TORCH)
  execute_process(
    COMMAND "${HIPFERRY_PYTHON}" -c
      "import torch; print('rocm' if torch.version.hip else 'cuda' if torch.version.cuda else 'cpu', torch.__version__)"
    OUTPUT_VARIABLE _torch_probe OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _torch_rc ERROR_VARIABLE _torch_err)
  if(NOT _torch_rc EQUAL 0)
    message(FATAL_ERROR "hipferry: cannot import torch with ${HIPFERRY_PYTHON}:\n${_torch_err}\n"
                        "Install PyTorch first (pip install torch), or configure with "
                        "-DHIPFERRY_BUILD_TORCH=OFF to build only the C++ libraries and tests.")
  endif()
  separate_arguments(_torch_probe)
  list(GET _torch_probe 0 HIPFERRY_TORCH_FLAVOR)
  list(GET _torch_probe 1 HIPFERRY_TORCH_VERSION)
endif()

if(HIPFERRY_TARGET STREQUAL "auto")
  if(HIPFERRY_TORCH_FLAVOR STREQUAL "")
    set(HIPFERRY_RESOLVED_TARGET "cpu")
  else()
    set(HIPFERRY_RESOLVED_TARGET "${HIPFERRY_TORCH_FLAVOR}")
  endif()
else()
  set(HIPFERRY_RESOLVED_TARGET "${HIPFERRY_TARGET}")
  if(NOT HIPFERRY_TORCH_FLAVOR STREQUAL "" AND NOT HIPFERRY_TARGET STREQUAL "cpu"
     AND NOT HIPFERRY_TARGET STREQUAL HIPFERRY_TORCH_FLAVOR)
    message(FATAL_ERROR
      "hipferry: HIPFERRY_TARGET=${HIPFERRY_TARGET} contradicts the installed torch "
      "${HIPFERRY_TORCH_VERSION}, which is a ${HIPFERRY_TORCH_FLAVOR} build. Either install a "
      "${HIPFERRY_TARGET} build of torch, or set HIPFERRY_TARGET=auto (builds for "
      "${HIPFERRY_TORCH_FLAVOR}) or HIPFERRY_TARGET=cpu (CPU-only extension).")
  endif()
endif()

# A GPU target whose compiler is missing: an explicit target fails; auto (e.g.
# a laptop with PyPI's CUDA torch and no toolkit) builds the CPU-only extension.
macro(hipferry_missing_gpu_compiler)
  string(CONCAT _msg ${ARGN})
  if(HIPFERRY_TARGET STREQUAL "auto")
    message(WARNING "hipferry: ${_msg} Building the CPU-only extension instead.")
    set(HIPFERRY_RESOLVED_TARGET "cpu")
  else()
    message(FATAL_ERROR "hipferry: ${_msg}")
  endif()
endmacro()

# The rocm target compiles with ROCm's Clang (hipcc's own compiler): host files
# as C++, .hip files as HIP through hip::device. Found from ROCm's llvm, else
# from hipcc itself (e.g. Debian's hipcc uses clang++-15). CXX overrides.
if(HIPFERRY_RESOLVED_TARGET STREQUAL "rocm" AND NOT CMAKE_CXX_COMPILER AND NOT DEFINED ENV{CXX})
  find_program(HIPFERRY_HIPCC hipcc HINTS "$ENV{ROCM_PATH}/bin" /opt/rocm/bin)
  if(NOT HIPFERRY_HIPCC)
    hipferry_missing_gpu_compiler("the rocm target needs ROCm's hipcc, which was not found. Install "
                                  "ROCm (or Debian's 'hipcc'), put hipcc on PATH or set CXX to ROCm's "
                                  "clang++; or set HIPFERRY_TARGET=cpu.")
  else()
    execute_process(COMMAND "${HIPFERRY_HIPCC}" --version OUTPUT_VARIABLE _hipcc_version ERROR_QUIET)
    string(REGEX MATCH "clang version ([0-9]+)" _m "${_hipcc_version}")
    set(_clang_major "${CMAKE_MATCH_1}")
    execute_process(COMMAND hipconfig --hipclangpath OUTPUT_VARIABLE _hip_clang_dir
                    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    find_program(HIPFERRY_HIP_CLANG NAMES amdclang++ clang++-${_clang_major} clang++
                 HINTS "$ENV{ROCM_PATH}/llvm/bin" /opt/rocm/llvm/bin "${_hip_clang_dir}" NO_DEFAULT_PATH)
    if(NOT HIPFERRY_HIP_CLANG)
      message(FATAL_ERROR "hipferry: found hipcc but not the Clang it uses; set CXX to ROCm's clang++.")
    endif()
    set(CMAKE_CXX_COMPILER "${HIPFERRY_HIP_CLANG}")
  endif()
endif()
message(STATUS "hipferry: target ${HIPFERRY_RESOLVED_TARGET} (HIPFERRY_TARGET=${HIPFERRY_TARGET}, "
               "torch: ${HIPFERRY_TORCH_FLAVOR} ${HIPFERRY_TORCH_VERSION})")
