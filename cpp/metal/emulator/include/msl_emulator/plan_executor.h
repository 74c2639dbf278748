// Executes a Metal dispatch plan (cpp/metal/plan/plan.h) on the MSL emulator.
#pragma once

#include <cstddef>
#include <string>

#include "metal/plan/plan.h"
#include "msl_emulator/runtime.h"

namespace msl::emu {

// Memory for each plan role (indexed by int(Role)); size in bytes.
struct RoleMemory {
  void* data[16] = {};
  size_t size[16] = {};
  void set(fatrain::metal_plan::Role role, void* d, size_t s) {
    data[int(role)] = d;
    size[int(role)] = s;
  }
};

// Runs every dispatch of `plan` in order; allocates the plan's scratch
// buffers. Checks each bound buffer against required_bytes(problem, role)
// first (the host-side validation a Metal executor does). Returns "" or the
// first error.
std::string execute_plan(const fatrain::metal_plan::Problem& problem,
                         const fatrain::metal_plan::Plan& plan, RoleMemory memory,
                         const msl::rt::ParallelFor& parallel);

}  // namespace msl::emu
