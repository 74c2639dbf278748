# The `metal` implementation on macOS: the Metal host executor (cpp/metal/host,
# metal-cpp) and its XLA FFI handlers (cpp/ffi/metal_ffi.cc ->
# jax_fatrain/_metal_ffi). include()d from CMakeLists.txt only if(APPLE), after
# Python, nanobind and XLA_FFI_INCLUDE_DIR are set up. Linux never reads this
# file (there the executor is only type-checked: tests/metal_typecheck/).
#
# metal-cpp (header-only, Apache-2.0) is not a system component. No PyPI
# package installs its headers, so:
#   * -DJAX_FATRAIN_METAL_CPP_DIR=<dir with Metal/Metal.hpp> uses a local copy
#     (e.g. Apple's metal-cpp zip unpacked; offline builds), else
#   * the build downloads the pymetal-cpp 0.1.5 source distribution from the
#     configured Python package index with pip (the same headers the Linux CI
#     type-checks against), checks its SHA-256 and unpacks thirdparty/metal-cpp
#     into the build tree. This happens on macOS only.
option(JAX_FATRAIN_METAL "Build the Metal backend (macOS)" ON)
if(NOT JAX_FATRAIN_METAL)
  return()
endif()

get_filename_component(_fatrain_root "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)

set(JAX_FATRAIN_METAL_CPP_DIR "" CACHE PATH "metal-cpp headers (contains Metal/Metal.hpp)")
if(NOT JAX_FATRAIN_METAL_CPP_DIR)
  set(_sdist_dir "${CMAKE_BINARY_DIR}/_pymetal_cpp")
  set(_sdist "${_sdist_dir}/pymetal_cpp-0.1.5.tar.gz")
  set(_sdist_sha256 "1118062f635277a2781659fbc4e7e5bac7d565d6948a3461c3b04d6425c15a0e")
  if(NOT EXISTS "${_sdist_dir}/pymetal_cpp-0.1.5/thirdparty/metal-cpp/Metal/Metal.hpp")
    message(STATUS "metal-cpp: downloading the pymetal-cpp 0.1.5 sdist with pip")
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -m pip download --no-deps --no-binary :all:
              --no-build-isolation pymetal-cpp==0.1.5 -d "${_sdist_dir}"
      RESULT_VARIABLE _rc)
    if(NOT _rc EQUAL 0 OR NOT EXISTS "${_sdist}")
      message(FATAL_ERROR "could not download pymetal-cpp==0.1.5 (for its metal-cpp headers); "
                          "pass -DJAX_FATRAIN_METAL_CPP_DIR=<metal-cpp> or "
                          "-DJAX_FATRAIN_METAL=OFF")
    endif()
    file(SHA256 "${_sdist}" _got)
    if(NOT _got STREQUAL _sdist_sha256)
      message(FATAL_ERROR "pymetal-cpp sdist SHA-256 mismatch: ${_got}")
    endif()
    file(ARCHIVE_EXTRACT INPUT "${_sdist}" DESTINATION "${_sdist_dir}"
         PATTERNS "pymetal_cpp-0.1.5/thirdparty/metal-cpp")
  endif()
  set(JAX_FATRAIN_METAL_CPP_DIR "${_sdist_dir}/pymetal_cpp-0.1.5/thirdparty/metal-cpp")
endif()
if(NOT EXISTS "${JAX_FATRAIN_METAL_CPP_DIR}/Metal/Metal.hpp")
  message(FATAL_ERROR "no Metal/Metal.hpp under JAX_FATRAIN_METAL_CPP_DIR=${JAX_FATRAIN_METAL_CPP_DIR}")
endif()
message(STATUS "metal-cpp: ${JAX_FATRAIN_METAL_CPP_DIR}")

nanobind_add_module(_metal_ffi NB_STATIC
  "${_fatrain_root}/cpp/ffi/metal_ffi.cc"
  "${_fatrain_root}/cpp/metal/host/executor.cc"
  "${_fatrain_root}/cpp/metal/plan/plan.cc")
target_include_directories(_metal_ffi PRIVATE
  "${XLA_FFI_INCLUDE_DIR}" "${_fatrain_root}/cpp" "${_fatrain_root}/cpp/ffi"
  "${_fatrain_root}/jax_fatrain/metal")
target_include_directories(_metal_ffi SYSTEM PRIVATE "${JAX_FATRAIN_METAL_CPP_DIR}")
# IOKit and CoreFoundation: the host reads the GPU's core count from the IORegistry.
target_link_libraries(_metal_ffi PRIVATE
  "-framework Metal" "-framework Foundation" "-framework QuartzCore"
  "-framework IOKit" "-framework CoreFoundation")
install(TARGETS _metal_ffi LIBRARY DESTINATION jax_fatrain)

# Optional: the kernels precompiled into a metallib when the Metal compiler is
# installed (Xcode's Metal toolchain). Without it (or if it fails), the
# extension compiles the packaged .metal sources once per process at run time.
execute_process(COMMAND xcrun -sdk macosx -find metal
                RESULT_VARIABLE _xcrun_rc OUTPUT_QUIET ERROR_QUIET)
if(_xcrun_rc EQUAL 0)
  set(_metal_dir "${_fatrain_root}/jax_fatrain/metal")
  set(_lib "${CMAKE_CURRENT_BINARY_DIR}/flash_attn.metallib")
  set(_air)
  foreach(_src flash_attn_train_fwd flash_attn_train_bwd)
    list(APPEND _air "${CMAKE_CURRENT_BINARY_DIR}/${_src}.air")
  endforeach()
  # One shell command that never fails the build: no metallib on error.
  add_custom_command(
    OUTPUT "${_lib}"
    COMMAND sh -c "xcrun -sdk macosx metal -std=metal3.1 -fno-fast-math -c \"$0/flash_attn_train_fwd.metal\" -o \"$1\" && xcrun -sdk macosx metal -std=metal3.1 -fno-fast-math -c \"$0/flash_attn_train_bwd.metal\" -o \"$2\" && xcrun -sdk macosx metallib \"$1\" \"$2\" -o \"$3\" || { echo 'jax_fatrain: building flash_attn.metallib failed; the kernels will be compiled at run time' >&2; touch \"$3\"; }"
            "${_metal_dir}" ${_air} "${_lib}"
    DEPENDS "${_metal_dir}/flash_attn_train_fwd.metal" "${_metal_dir}/flash_attn_train_bwd.metal"
            "${_metal_dir}/flash_attn_common.h" "${_metal_dir}/flash_attn_abi.h"
    COMMENT "Metal: flash_attn.metallib"
    VERBATIM)
  add_custom_target(fatrain_metallib ALL DEPENDS "${_lib}")
  install(FILES "${_lib}" DESTINATION jax_fatrain/metal OPTIONAL)
else()
  message(STATUS "Metal compiler not found (xcrun metal): kernels compile at run time")
endif()
