# The `metal_emulated` implementation: jax_fatrain/metal/*.metal run by the MSL
# emulator (cpp/metal/emulator) through the Metal dispatch plan (cpp/metal/plan).
# include()d from the top-level CMakeLists.txt after Python, nanobind and
# XLA_FFI_INCLUDE_DIR are set up. The kernels compile as C++ here.
option(JAX_FATRAIN_METAL_EMULATOR "Build the metal_emulated implementation (MSL emulator)" ON)

if(JAX_FATRAIN_METAL_EMULATOR)
  get_filename_component(_fatrain_root "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
  set(_msl_dir "${_fatrain_root}/cpp/metal/emulator")
  set(_emu_tests_dir "${_fatrain_root}/tests/metal_emulator")
  set(_metal_dir "${_fatrain_root}/jax_fatrain/metal")
  set(_gen_dir "${CMAKE_CURRENT_BINARY_DIR}/msl_emulator_gen")
  file(MAKE_DIRECTORY "${_gen_dir}")

  # The pre-pass enforces the rules of cpp/metal/emulator/msl_rules.py
  # (README.md there, "Rules"); a kernel that breaks one is not built. The
  # address-space rule needs clang++ ($FATRAIN_CLANGXX or on PATH); without
  # it that rule is skipped here (tests/test_metal_emulator.py still runs it).
  find_program(FATRAIN_CLANGXX NAMES clang++ DOC "clang++ for the MSL address-space rule")
  set(_msl_rule_args)
  if(FATRAIN_CLANGXX)
    list(APPEND _msl_rule_args --clang "${FATRAIN_CLANGXX}")
  else()
    message(WARNING "clang++ not found: the MSL emulator's address-space rule is skipped")
  endif()

  # Pre-pass: .metal -> C++ with binding glue (kept line-accurate via #line).
  set(_msl_generated)
  foreach(_src flash_attn_train_fwd flash_attn_train_bwd)
    add_custom_command(
      OUTPUT "${_gen_dir}/${_src}.cc"
      COMMAND "${Python_EXECUTABLE}" "${_msl_dir}/msl_prepass.py"
              "${_metal_dir}/${_src}.metal" "${_gen_dir}/${_src}.cc" --cxx "${CMAKE_CXX_COMPILER}"
              ${_msl_rule_args}
      DEPENDS "${_metal_dir}/${_src}.metal" "${_metal_dir}/flash_attn_common.h"
              "${_metal_dir}/flash_attn_tiles.h"
              "${_metal_dir}/flash_attn_abi.h" "${_msl_dir}/msl_prepass.py" "${_msl_dir}/msl_rules.py"
              "${_msl_dir}/include/metal_stdlib"
      COMMENT "MSL pre-pass: ${_src}.metal"
      VERBATIM)
    list(APPEND _msl_generated "${_gen_dir}/${_src}.cc")
  endforeach()
  add_custom_command(
    OUTPUT "${_gen_dir}/emulator_test_kernels.cc"
    COMMAND "${Python_EXECUTABLE}" "${_msl_dir}/msl_prepass.py"
            "${_emu_tests_dir}/emulator_test_kernels.metal" "${_gen_dir}/emulator_test_kernels.cc"
            --cxx "${CMAKE_CXX_COMPILER}" ${_msl_rule_args}
    DEPENDS "${_emu_tests_dir}/emulator_test_kernels.metal" "${_msl_dir}/msl_prepass.py"
            "${_msl_dir}/msl_rules.py" "${_msl_dir}/include/metal_stdlib"
    COMMENT "MSL pre-pass: emulator_test_kernels.metal"
    VERBATIM)

  # Runtime, plan and plan executor.
  add_library(fatrain_msl_emulator OBJECT
    "${_msl_dir}/src/runtime.cc"
    "${_msl_dir}/src/plan_executor.cc"
    "${_fatrain_root}/cpp/metal/plan/plan.cc")
  target_include_directories(fatrain_msl_emulator PUBLIC "${_msl_dir}/include" "${_fatrain_root}/cpp"
                             "${_metal_dir}")
  target_compile_options(fatrain_msl_emulator PRIVATE -O2)

  # The kernels (and the emulator's own test kernels), compiled as C++.
  add_library(fatrain_msl_kernels OBJECT
    ${_msl_generated}
    "${_gen_dir}/emulator_test_kernels.cc"
    "${_emu_tests_dir}/emulator_selftest.cc")
  target_include_directories(fatrain_msl_kernels PRIVATE "${_msl_dir}/include")
  target_compile_options(fatrain_msl_kernels PRIVATE -O2 -Wno-unused-variable -Wno-unused-parameter)

  nanobind_add_module(_metal_emulated_ffi NB_STATIC "${_fatrain_root}/cpp/ffi/metal_emulated_ffi.cc")
  target_include_directories(_metal_emulated_ffi PRIVATE "${XLA_FFI_INCLUDE_DIR}")
  target_link_libraries(_metal_emulated_ffi PRIVATE fatrain_msl_emulator fatrain_msl_kernels)
  install(TARGETS _metal_emulated_ffi LIBRARY DESTINATION jax_fatrain)
endif()
