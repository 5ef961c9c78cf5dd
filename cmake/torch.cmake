# The torch module hipferry._C, on LibTorch's stable ABI only (torch/csrc/stable
# and the stable C shim; csrc/torch/stable.h): it includes no ATen or c10
# header and links libtorch_cpu alone (no libtorch_python: tensors cross to
# Python through csrc/torch/tensor_bridge.h). TORCH_TARGET_VERSION is the
# oldest torch it supports, so the headers offer only what that release
# exports, and one binary loads under it and every newer release.
set(HIPFERRY_TORCH_OLDEST "2.13" CACHE STRING "Oldest torch minor the module targets (TORCH_TARGET_VERSION)")

execute_process(
  COMMAND "${HIPFERRY_PYTHON}" -c
    "import os, torch; d = os.path.dirname(torch.__file__); print(';'.join([os.path.join(d, 'include'), os.path.join(d, 'lib')]))"
  OUTPUT_VARIABLE _torch_paths OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
list(GET _torch_paths 0 HIPFERRY_TORCH_INCLUDE)
list(GET _torch_paths 1 HIPFERRY_TORCH_LIB)

string(REPLACE "." ";" _oldest "${HIPFERRY_TORCH_OLDEST}")
list(GET _oldest 0 _oldest_major)
list(GET _oldest 1 _oldest_minor)
# TORCH_VERSION_X_Y_0 of torch/csrc/stable/version.h: major << 56 | minor << 48.
math(EXPR _target_version "(${_oldest_major} << 56) | (${_oldest_minor} << 48)" OUTPUT_FORMAT HEXADECIMAL)

add_library(hipferry_torch INTERFACE)
target_include_directories(hipferry_torch SYSTEM INTERFACE "${HIPFERRY_TORCH_INCLUDE}")
target_compile_definitions(hipferry_torch INTERFACE TORCH_TARGET_VERSION=${_target_version}ULL)
find_library(HIPFERRY_LIB_torch_cpu torch_cpu PATHS "${HIPFERRY_TORCH_LIB}" NO_DEFAULT_PATH REQUIRED)
target_link_libraries(hipferry_torch INTERFACE "${HIPFERRY_LIB_torch_cpu}" dl)

execute_process(COMMAND "${HIPFERRY_PYTHON}" -m pybind11 --cmakedir
                OUTPUT_VARIABLE pybind11_DIR OUTPUT_STRIP_TRAILING_WHITESPACE
                COMMAND_ERROR_IS_FATAL ANY)
set(PYBIND11_FINDPYTHON ON)
set(Python_EXECUTABLE "${HIPFERRY_PYTHON}")
find_package(pybind11 CONFIG REQUIRED)

pybind11_add_module(_C MODULE
  csrc/torch/stable.cpp
  csrc/torch/tensor_bridge.cpp
  csrc/torch/ops.cpp
  csrc/torch/copy_cast_checks.cpp
  csrc/torch/copy_cast_cpu.cpp
  csrc/torch/pinned_pool.cpp
  csrc/torch/pool_bindings.cpp
  csrc/torch/pool_fast_path.cpp
  csrc/torch/current_stream.cpp
  csrc/torch/transfer_engine.cpp
  csrc/torch/transfer_checks.cpp
  csrc/torch/transfer_start.cpp
  csrc/torch/transfer_bindings.cpp
  csrc/torch/adamw_step.cpp
  csrc/torch/adamw8bit_step.cpp
  csrc/torch/disk_bindings.cpp
  csrc/torch/adamw_streamer.cpp
  csrc/torch/layer_copier.cpp
  csrc/torch/in_flight_bindings.cpp
  csrc/torch/content_hash.cpp
  csrc/torch/thread_fp_modes.cpp
  csrc/torch/python_module.cpp)
if(NOT HIPFERRY_RESOLVED_TARGET STREQUAL "cpu")
  target_sources(_C PRIVATE csrc/torch/copy_cast_gpu.cpp csrc/torch/adamw_step_gpu.cpp)
endif()
# Test and benchmark hooks (hipferry._C._testing): only in builds made for the tests.
if(HIPFERRY_TEST_HOOKS)
  target_sources(_C PRIVATE csrc/testing/test_hooks.cpp csrc/testing/disk_faults.cpp)
  target_compile_definitions(_C PRIVATE HIPFERRY_TEST_HOOKS)
endif()
# C++17: what the stable headers need, on every torch release (ATen's own
# headers asked for C++20 from torch 2.15 on; the module includes none).
set_target_properties(_C PROPERTIES CXX_STANDARD 17)
target_link_libraries(_C PRIVATE hipferry_engine hipferry_torch)
target_compile_definitions(_C PRIVATE HIPFERRY_TORCH_VERSION="${HIPFERRY_TORCH_VERSION}")
target_compile_options(_C PRIVATE -Wall -Wextra -Wno-unused-parameter)
# Code pulled in from static archives stays private to the module. A toolchain
# that links parts of libstdc++ statically (seen: a GCC in /opt/gcc on a CUDA
# image) otherwise exports a second copy of the iostream/locale code next to
# the process's libstdc++.so, and the first error message with a number in it
# crashed. With the system compiler the module links libstdc++.so only.
if(CMAKE_SYSTEM_NAME STREQUAL "Linux")
  target_link_options(_C PRIVATE "LINKER:--exclude-libs,ALL")
endif()
if(HIPFERRY_OUTPUT_DIR)  # setup.py puts the module where setuptools packages it
  set_target_properties(_C PROPERTIES LIBRARY_OUTPUT_DIRECTORY "${HIPFERRY_OUTPUT_DIR}")
  set(_build_config_dir "${HIPFERRY_OUTPUT_DIR}")
else()
  set(_build_config_dir "${CMAKE_CURRENT_BINARY_DIR}")
endif()

# The torch releases the module loads under: the stable ABI's promise is that
# a module built for TORCH_TARGET_VERSION loads under that release and every
# newer one. The import check, `doctor` and the README read this record; it
# travels in the wheel next to the module.
set(HIPFERRY_TORCH_ABI "LibTorch stable ABI (torch/csrc/stable, C shim), TORCH_TARGET_VERSION ${HIPFERRY_TORCH_OLDEST}")
string(REGEX MATCH "^[0-9]+\\.[0-9]+" HIPFERRY_TORCH_NEWEST "${HIPFERRY_TORCH_VERSION}")
set(HIPFERRY_TORCH_NEWER_LOADS True)
if(HIPFERRY_RUNTIME_MAJOR STREQUAL "")
  set(HIPFERRY_RUNTIME_MAJOR_PY None)
else()
  set(HIPFERRY_RUNTIME_MAJOR_PY "${HIPFERRY_RUNTIME_MAJOR}")
endif()
configure_file("${CMAKE_CURRENT_SOURCE_DIR}/cmake/build_config.py.in" "${_build_config_dir}/_build_config.py" @ONLY)
