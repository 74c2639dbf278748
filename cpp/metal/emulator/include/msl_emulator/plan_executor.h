// Executes a Metal dispatch plan (cpp/metal/plan/plan.h) on the MSL emulator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "metal/plan/plan.h"
#include "metal/plan/role_buffers.h"
#include "msl_emulator/runtime.h"

namespace msl::emu {

// Memory for each plan role (indexed by int(Role)); size in bytes.
struct RoleMemory {
  // As many roles as the hosts' RoleBuffers, which are copied in whole.
  static constexpr int kRoles = fatrain::metal_plan::RoleBuffers::kRoles;
  void* data[kRoles] = {};
  size_t size[kRoles] = {};
  void set(fatrain::metal_plan::Role role, void* d, size_t s) {
    data[int(role)] = d;
    size[int(role)] = s;
  }
};

// One executed dispatch and its counters.
struct DispatchRecord {
  std::string kernel;
  uint32_t grid[3] = {1, 1, 1};
  uint32_t threadgroup[3] = {1, 1, 1};
  uint32_t threadgroup_memory_length = 0;
  msl::rt::DispatchStats stats;
};

// Runs every dispatch of `plan` in order; allocates the plan's scratch
// buffers. Checks each bound buffer against required_bytes(problem, role)
// first (the host-side validation a Metal executor does). Returns "" or the
// first error. With `records`, each dispatch also counts its costs (races are
// then counted, not errors) and appends a record; `sample` selects the
// threadgroups each dispatch runs (see msl::rt::Sampling).
std::string execute_plan(const fatrain::metal_plan::Problem& problem,
                         const fatrain::metal_plan::Plan& plan, RoleMemory memory,
                         const msl::rt::ParallelFor& parallel,
                         std::vector<DispatchRecord>* records = nullptr,
                         const msl::rt::Sampling& sample = {});

}  // namespace msl::emu
