# GPU language and architectures for the resolved target. Defines
#   hipferry_gpu_sources(<target> <files...>)  compile files as GPU code
#   HIPFERRY_GPU_ARCHITECTURES                 what is compiled for
# Architectures come from the user, never one hard-coded chip:
#   rocm: HIPFERRY_ROCM_ARCHS, else $PYTORCH_ROCM_ARCH, else the default below
#   cuda: HIPFERRY_CUDA_ARCHS, else $TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX"), else default

set(HIPFERRY_DEFAULT_ROCM_ARCHS "gfx908;gfx90a;gfx942;gfx1030;gfx1100;gfx1101")
set(HIPFERRY_DEFAULT_CUDA_ARCHS "75-real;80-real;86-real;89-real;90-real;100-real;120")

function(_hipferry_list_from_env out env_value)
  string(REPLACE " " ";" value "${env_value}")
  list(FILTER value EXCLUDE REGEX "^$")
  set(${out} "${value}" PARENT_SCOPE)
endfunction()

if(HIPFERRY_RESOLVED_TARGET STREQUAL "rocm")
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "hipferry: the rocm target compiles with ROCm's Clang, but the C++ "
                        "compiler is ${CMAKE_CXX_COMPILER}. Configure with CXX=/opt/rocm/llvm/bin/clang++.")
  endif()
  if(HIPFERRY_ROCM_ARCHS)
    set(_archs "${HIPFERRY_ROCM_ARCHS}")
  elseif(DEFINED ENV{PYTORCH_ROCM_ARCH} AND NOT "$ENV{PYTORCH_ROCM_ARCH}" STREQUAL "")
    _hipferry_list_from_env(_archs "$ENV{PYTORCH_ROCM_ARCH}")
  else()
    set(_archs "${HIPFERRY_DEFAULT_ROCM_ARCHS}")
  endif()
  set(GPU_TARGETS "${_archs}" CACHE STRING "AMD GPU targets" FORCE)
  set(AMDGPU_TARGETS "${_archs}" CACHE STRING "AMD GPU targets" FORCE)
  # Debian installs hip-config.cmake under the multiarch dir; ROCm under /opt/rocm.
  find_package(hip REQUIRED CONFIG PATHS /opt/rocm /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/cmake/hip)
  set(HIPFERRY_GPU_ARCHITECTURES "${_archs}")
  set(HIPFERRY_RUNTIME_MAJOR "${hip_VERSION_MAJOR}")  # the HIP major torch must use too (import check)
  # ROCm's own Clang finds the HIP headers and device libraries by itself; a
  # distribution Clang (Debian's) is told where they are, as hipcc would.
  execute_process(COMMAND hipconfig --rocmpath OUTPUT_VARIABLE _rocm_path
                  OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  set(HIPFERRY_HIP_FLAGS "")
  if(_rocm_path)
    list(APPEND HIPFERRY_HIP_FLAGS "--rocm-path=${_rocm_path}")
  endif()
  foreach(_bitcode "${_rocm_path}/amdgcn/bitcode" "${_rocm_path}/lib/${CMAKE_LIBRARY_ARCHITECTURE}/amdgcn/bitcode"
                   "/usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/amdgcn/bitcode")
    if(EXISTS "${_bitcode}/ockl.bc")
      list(APPEND HIPFERRY_HIP_FLAGS "--hip-device-lib-path=${_bitcode}")
      break()
    endif()
  endforeach()

  function(hipferry_gpu_sources target)
    target_compile_options(${target} PRIVATE ${HIPFERRY_HIP_FLAGS})
    set_source_files_properties(${ARGN} PROPERTIES LANGUAGE CXX)
    target_sources(${target} PRIVATE ${ARGN})
    target_link_libraries(${target} PRIVATE hip::device)
    target_compile_definitions(${target} PRIVATE __HIP_PLATFORM_AMD__=1)
  endfunction()

elseif(HIPFERRY_RESOLVED_TARGET STREQUAL "cuda")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc AND NOT DEFINED ENV{CUDACXX})
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    hipferry_missing_gpu_compiler("the cuda target needs nvcc, which was not found. Install the "
                                  "CUDA toolkit, set CUDACXX=/path/to/nvcc, or set HIPFERRY_TARGET=cpu.")
  endif()
endif()

if(HIPFERRY_RESOLVED_TARGET STREQUAL "cuda")
  if(HIPFERRY_CUDA_ARCHS)
    set(_archs "${HIPFERRY_CUDA_ARCHS}")
  elseif(DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT "$ENV{TORCH_CUDA_ARCH_LIST}" STREQUAL "")
    # torch's form "8.0;9.0+PTX" -> CMake's "80-real;90"
    _hipferry_list_from_env(_torch_list "$ENV{TORCH_CUDA_ARCH_LIST}")
    set(_archs "")
    foreach(a IN LISTS _torch_list)
      string(REGEX MATCH "^([0-9]+)\\.([0-9]+)([a-z]?)(\\+PTX)?$" _m "${a}")
      if(NOT _m)
        message(FATAL_ERROR "hipferry: TORCH_CUDA_ARCH_LIST entry '${a}' is not of the form 9.0 or 9.0+PTX")
      endif()
      if(CMAKE_MATCH_4)
        list(APPEND _archs "${CMAKE_MATCH_1}${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
      else()
        list(APPEND _archs "${CMAKE_MATCH_1}${CMAKE_MATCH_2}${CMAKE_MATCH_3}-real")
      endif()
    endforeach()
  else()
    set(_archs "${HIPFERRY_DEFAULT_CUDA_ARCHS}")
  endif()
  set(CMAKE_CUDA_ARCHITECTURES "${_archs}")
  # Share one CUDA runtime with torch instead of a static copy.
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
  enable_language(CUDA)
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  find_package(CUDAToolkit REQUIRED)
  set(HIPFERRY_GPU_ARCHITECTURES "${_archs}")
  set(HIPFERRY_RUNTIME_MAJOR "${CUDAToolkit_VERSION_MAJOR}")  # the CUDA major torch must use too (import check)
  function(hipferry_gpu_sources target)
    set_source_files_properties(${ARGN} PROPERTIES LANGUAGE CUDA)
    target_sources(${target} PRIVATE ${ARGN})
    target_link_libraries(${target} PUBLIC CUDA::cudart)
    target_compile_definitions(${target} PRIVATE HIPFERRY_PLATFORM_CUDA=1)
    set_target_properties(${target} PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")
    # No contraction of a*b+c into an FMA (see CMakeLists.txt): same rounding as the CPU loop.
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--fmad=false>)
  endfunction()
elseif(HIPFERRY_RESOLVED_TARGET STREQUAL "cpu")
  set(HIPFERRY_GPU_ARCHITECTURES "")
  set(HIPFERRY_RUNTIME_MAJOR "")
endif()
message(STATUS "hipferry: GPU architectures: ${HIPFERRY_GPU_ARCHITECTURES}")
