// The macOS Metal host: executes a dispatch plan (cpp/metal/plan/plan.h) on
// the Apple GPU. Every decision that is not a Metal API call (kernel names,
// function constants, bindings, setBytes data, scratch, grid, threadgroup
// size, validation) is the plan's; this executor only carries it out.
//
// No Metal types in this header: callers (cpp/ffi/metal_ffi.cc) see plain
// pointers and strings.
#pragma once

#include <string>

#include "metal/plan/plan.h"
#include "metal/plan/role_buffers.h"

namespace fatrain::metal {

// The system default Metal device's name, or "" when there is none.
std::string device_name();

// "" when the default device can run the kernels (Apple7+ family, Metal 3, and
// macOS 14 or newer for Metal Shading Language 3.1), else why not.
std::string unsupported_reason();

// The default Metal device's GPU core count, 0 when it is not known. Metal
// has no API for it: it is the "gpu-core-count" integer of the device's
// IORegistry entry (the AGX accelerator service whose registry ID the
// MTLDevice reports), looked up once per process and device. The backward
// plan sizes its dQ splits by it (cpp/metal/plan/plan.h).
int gpu_core_count();

// Creates the process's device, command queue and kernel library, once.
// `metallib_path`: a library built at install time ("" or unreadable: not
// used); otherwise `source` (the packaged .metal sources as one MSL
// translation unit) is compiled. Returns "" or why it failed. Later calls
// return the first call's result.
std::string initialize(const std::string& source, const std::string& metallib_path);

// Runs every dispatch of `plan` in one command buffer and waits for it.
// Operands are bound without a copy when pointer and length are page aligned,
// otherwise through pooled shared-storage buffers (inputs copied in before,
// outputs copied back after). When `poison_outputs`, outputs are filled with
// 0xFF first. Thread safe. Returns "" or the error (Metal's message included).
std::string execute(const metal_plan::Problem& problem, const metal_plan::Plan& plan,
                    const metal_plan::RoleBuffers& memory, bool poison_outputs);

}  // namespace fatrain::metal
