// Host memory for each role of a Metal dispatch plan (see plan.h): what an
// executor (the macOS Metal host or the MSL emulator) binds to the plan's
// device-buffer bindings. Portable: no Metal, no XLA.
#pragma once

#include <cstddef>

#include "metal/plan/plan.h"

namespace fatrain::metal_plan {

struct RoleBuffers {
  static constexpr int kRoles = 20;  // > number of Role values
  void* data[kRoles] = {};
  size_t size[kRoles] = {};
  bool output[kRoles] = {};  // written by the plan (copied back when staged)
  void set(Role role, void* d, size_t s, bool is_output = false) {
    data[int(role)] = d;
    size[int(role)] = s;
    output[int(role)] = is_output;
  }
};

}  // namespace fatrain::metal_plan
