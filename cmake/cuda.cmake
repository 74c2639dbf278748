# The CUDA backend (cpp/cuda/, cpp/ffi/cuda_ffi.cc -> jax_fatrain/_cuda_ffi).
# Included from CMakeLists.txt when JAX_FATRAIN_CUDA is ON. Builds only where a
# CUDA compiler is found; otherwise it says so and the package builds without
# it (implementation="cuda" then reports "not available").
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  message(WARNING "JAX_FATRAIN_CUDA is ON but no CUDA compiler was found; "
                  "building without the CUDA backend")
  return()
endif()

enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)

# sm_80 (Ampere) and sm_90a (Hopper): the mma.sync / ldmatrix / cp.async
# kernels run on both; the hopper_*.cu wgmma kernels only in sm_90a code.
# Override with -DJAX_FATRAIN_CUDA_GENCODE="...".
set(JAX_FATRAIN_CUDA_GENCODE
    "-gencode=arch=compute_80,code=sm_80;-gencode=arch=compute_90a,code=sm_90a"
    CACHE STRING "nvcc -gencode flags for the CUDA kernels")

add_library(fatrain_cuda_kernels STATIC
  cpp/cuda/attention_cuda.cu
  cpp/cuda/tc_fwd.cu
  cpp/cuda/tc_bwd.cu
  cpp/cuda/tc_dq.cu
  cpp/cuda/hopper_fwd_ws.cu
  cpp/cuda/hopper_bwd_ws.cu
  cpp/cuda/segments.cu
  cpp/cuda/simt.cu)
set_target_properties(fatrain_cuda_kernels PROPERTIES
  CUDA_ARCHITECTURES OFF
  POSITION_INDEPENDENT_CODE ON
  CUDA_SEPARABLE_COMPILATION OFF)
target_compile_options(fatrain_cuda_kernels PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:${JAX_FATRAIN_CUDA_GENCODE} -O3 --expt-relaxed-constexpr>)
# The wgmma kernels have a body only in sm_90a code; the host side launches
# them only when this build made some (see has_sm90a_code in cpp/cuda/launch.h).
if(JAX_FATRAIN_CUDA_GENCODE MATCHES "sm_90a")
  target_compile_definitions(fatrain_cuda_kernels PRIVATE JAX_FATRAIN_CUDA_SM90A)
endif()
target_include_directories(fatrain_cuda_kernels PUBLIC cpp)
target_link_libraries(fatrain_cuda_kernels PUBLIC CUDA::cudart_static)

nanobind_add_module(_cuda_ffi NB_STATIC cpp/ffi/cuda_ffi.cc)
target_include_directories(_cuda_ffi PRIVATE "${XLA_FFI_INCLUDE_DIR}" cpp)
target_link_libraries(_cuda_ffi PRIVATE fatrain_cuda_kernels CUDA::cudart_static)
install(TARGETS _cuda_ffi LIBRARY DESTINATION jax_fatrain)

# A standalone check of the kernels against a double-precision reference, with
# no JAX in the process (cpp/cuda/tests/kernel_check.cc; tools/cuda_gpu_tests.sh
# runs it under compute-sanitizer). Built only when asked for:
#   cmake --build BUILD --target fatrain_cuda_kernel_check
add_executable(fatrain_cuda_kernel_check EXCLUDE_FROM_ALL cpp/cuda/tests/kernel_check.cc)
target_include_directories(fatrain_cuda_kernel_check PRIVATE cpp)
target_link_libraries(fatrain_cuda_kernel_check PRIVATE fatrain_cuda_kernels CUDA::cudart_static)
