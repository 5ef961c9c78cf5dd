# The torch module hipferry._C. Links only torch's device-generic libraries
# (c10, torch_cpu, torch_python for the tensor <-> Python casts): no torch GPU headers or libraries (design principle 3), so
# one source builds against many torch, ROCm and CUDA versions.

execute_process(
  COMMAND "${HIPFERRY_PYTHON}" -c
    "import os, torch; d = os.path.dirname(torch.__file__); print(';'.join([os.path.join(d, 'include'), os.path.join(d, 'lib'), str(int(torch._C._GLIBCXX_USE_CXX11_ABI)), str(int(torch.backends.openmp.is_available()))]))"
  OUTPUT_VARIABLE _torch_paths OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
list(GET _torch_paths 0 HIPFERRY_TORCH_INCLUDE)
list(GET _torch_paths 1 HIPFERRY_TORCH_LIB)
list(GET _torch_paths 2 HIPFERRY_TORCH_CXX11_ABI)
list(GET _torch_paths 3 HIPFERRY_TORCH_OPENMP)

add_library(hipferry_torch INTERFACE)
target_include_directories(hipferry_torch SYSTEM INTERFACE "${HIPFERRY_TORCH_INCLUDE}")
target_compile_definitions(hipferry_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${HIPFERRY_TORCH_CXX11_ABI})
foreach(lib c10 torch_cpu torch torch_python)
  find_library(HIPFERRY_LIB_${lib} ${lib} PATHS "${HIPFERRY_TORCH_LIB}" NO_DEFAULT_PATH REQUIRED)
  target_link_libraries(hipferry_torch INTERFACE "${HIPFERRY_LIB_${lib}}")
endforeach()

# at::parallel_for is inline: with an OpenMP build of torch its `omp parallel`
# is compiled into OUR objects, so they need -fopenmp (libgomp, as torch uses)
# or every CPU kernel silently runs on one thread. torch says which it is.
if(HIPFERRY_TORCH_OPENMP)
  if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    set(_openmp_flag -fopenmp=libgomp)
  else()
    set(_openmp_flag -fopenmp)
  endif()
  target_compile_options(hipferry_torch INTERFACE ${_openmp_flag})
  target_link_options(hipferry_torch INTERFACE ${_openmp_flag})
endif()

execute_process(COMMAND "${HIPFERRY_PYTHON}" -m pybind11 --cmakedir
                OUTPUT_VARIABLE pybind11_DIR OUTPUT_STRIP_TRAILING_WHITESPACE
                COMMAND_ERROR_IS_FATAL ANY)
set(PYBIND11_FINDPYTHON ON)
set(Python_EXECUTABLE "${HIPFERRY_PYTHON}")
find_package(pybind11 CONFIG REQUIRED)

pybind11_add_module(_C MODULE
  csrc/torch/ops.cpp
  csrc/torch/copy_cast_checks.cpp
  csrc/torch/copy_cast_cpu.cpp
  csrc/torch/pinned_pool.cpp
  csrc/torch/pool_bindings.cpp
  csrc/torch/current_stream.cpp
  csrc/torch/transfer_engine.cpp
  csrc/torch/transfer_bindings.cpp
  csrc/torch/adamw_step.cpp
  csrc/torch/adamw_streamer.cpp
  csrc/torch/layer_copier.cpp
  csrc/torch/in_flight_bindings.cpp
  csrc/torch/python_module.cpp)
if(NOT HIPFERRY_RESOLVED_TARGET STREQUAL "cpu")
  target_sources(_C PRIVATE csrc/torch/copy_cast_gpu.cpp)
endif()
# Test and benchmark hooks (hipferry._C._testing): only in builds made for the tests.
if(HIPFERRY_TEST_HOOKS)
  target_sources(_C PRIVATE csrc/testing/test_hooks.cpp)
  target_compile_definitions(_C PRIVATE HIPFERRY_TEST_HOOKS)
endif()
# The module is compiled with the C++ standard torch's headers ask for
# (torch 2.15 demands C++20, older releases are C++17): the compiler tells,
# by preprocessing ATen.h as C++17 (it stops at once where torch refuses it).
file(WRITE "${CMAKE_CURRENT_BINARY_DIR}/hipferry_torch_std_probe.cpp" "#include <ATen/ATen.h>\n")
execute_process(COMMAND "${CMAKE_CXX_COMPILER}" -std=c++17 -E -D_GLIBCXX_USE_CXX11_ABI=${HIPFERRY_TORCH_CXX11_ABI}
                        -isystem "${HIPFERRY_TORCH_INCLUDE}" "${CMAKE_CURRENT_BINARY_DIR}/hipferry_torch_std_probe.cpp"
                RESULT_VARIABLE _cxx17_rc OUTPUT_QUIET ERROR_QUIET)
if(_cxx17_rc EQUAL 0)
  set(HIPFERRY_TORCH_CXX_STANDARD 17)
else()
  set(HIPFERRY_TORCH_CXX_STANDARD 20)
endif()
message(STATUS "hipferry: torch module compiled as C++${HIPFERRY_TORCH_CXX_STANDARD}, as torch requires")
set_target_properties(_C PROPERTIES CXX_STANDARD ${HIPFERRY_TORCH_CXX_STANDARD})
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

# The torch releases the module loads under. It uses torch's C++ ABI, which
# changes with every minor release, so only the minor it was built against.
# The import check, `doctor` and the README read this record; it travels in
# the wheel next to the module.
set(HIPFERRY_TORCH_ABI "libtorch C++ ABI of torch ${HIPFERRY_TORCH_VERSION}, which changes with every minor release")
string(REGEX MATCH "^[0-9]+\\.[0-9]+" HIPFERRY_TORCH_OLDEST "${HIPFERRY_TORCH_VERSION}")
set(HIPFERRY_TORCH_NEWEST "${HIPFERRY_TORCH_OLDEST}")
set(HIPFERRY_TORCH_NEWER_LOADS False)
if(HIPFERRY_RUNTIME_MAJOR STREQUAL "")
  set(HIPFERRY_RUNTIME_MAJOR_PY None)
else()
  set(HIPFERRY_RUNTIME_MAJOR_PY "${HIPFERRY_RUNTIME_MAJOR}")
endif()
configure_file("${CMAKE_CURRENT_SOURCE_DIR}/cmake/build_config.py.in" "${_build_config_dir}/_build_config.py" @ONLY)
