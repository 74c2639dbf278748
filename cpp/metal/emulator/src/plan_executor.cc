// Executes a Metal dispatch plan on the MSL emulator.

#include "msl_emulator/plan_executor.h"

#include <cstring>
#include <memory>
#include <vector>

namespace msl::emu {

namespace mp = fatrain::metal_plan;

std::string execute_plan(const mp::Problem& problem, const mp::Plan& plan, RoleMemory memory,
                         const msl::rt::ParallelFor& parallel, std::vector<DispatchRecord>* records,
                         const msl::rt::Sampling& sample) {
  std::vector<std::unique_ptr<unsigned char[]>> scratch;
  for (const auto& s : plan.scratch) {
    scratch.emplace_back(new unsigned char[s.bytes]);
    // Poisoned: the plan must write scratch before reading it.
    std::memset(scratch.back().get(), 0xFF, s.bytes);
    memory.set(s.role, scratch.back().get(), s.bytes);
  }
  for (const auto& d : plan.dispatches) {
    // The plan is the one source of threads per threadgroup, and every kernel
    // it dispatches declares exactly that bound, so that Apple's compiler
    // budgets registers for the threadgroup the plan sends.
    const uint64_t threads = uint64_t(d.threadgroup[0]) * d.threadgroup[1] * d.threadgroup[2];
    if (const msl::rt::KernelEntry* entry = msl::rt::find_kernel(d.kernel); entry != nullptr) {
      if (!entry->declared_max_threads) {
        return "msl emulator: kernel " + d.kernel +
               " declares no [[max_total_threads_per_threadgroup(N)]]; the plan dispatches " +
               std::to_string(threads) + " threads per threadgroup";
      }
      if (entry->max_threads != threads) {
        return "msl emulator: kernel " + d.kernel + " declares max_total_threads_per_threadgroup(" +
               std::to_string(entry->max_threads) + "), the plan dispatches " +
               std::to_string(threads) + " threads per threadgroup";
      }
    }
    msl::rt::DispatchSpec spec;
    spec.kernel = d.kernel;
    for (auto [index, value] : d.constants) spec.constants.push_back({index, value ? 1.0 : 0.0});
    for (const auto& b : d.bindings) {
      msl::rt::BufferBinding bb;
      bb.index = b.index;
      if (b.is_bytes) {
        bb.is_bytes = true;
        bb.data = const_cast<uint8_t*>(b.bytes.data());
        bb.size = b.bytes.size();
      } else {
        const int r = int(b.role);
        if (memory.data[r] == nullptr) {
          return "kernel " + d.kernel + ": no memory for " + mp::role_name(b.role) +
                 " (buffer(" + std::to_string(b.index) + "))";
        }
        const uint64_t need = mp::required_bytes(problem, b.role);
        if (memory.size[r] < need) {
          return std::string("metal: ") + mp::role_name(b.role) + " buffer too small: expected at least " +
                 std::to_string(need) + " bytes, got " + std::to_string(memory.size[r]);
        }
        bb.data = memory.data[r];
        bb.size = memory.size[r];
      }
      spec.buffers.push_back(bb);
    }
    spec.threadgroup_memory_length = d.threadgroup_memory_length;
    spec.grid = {d.grid[0], d.grid[1], d.grid[2]};
    spec.threadgroup = {d.threadgroup[0], d.threadgroup[1], d.threadgroup[2]};
    spec.sample = sample;
    DispatchRecord record;
    std::string err = msl::rt::run_dispatch(spec, parallel, records ? &record.stats : nullptr);
    if (!err.empty()) return "msl emulator: " + err;
    if (records != nullptr) {
      record.kernel = d.kernel;
      for (int i = 0; i < 3; ++i) {
        record.grid[i] = d.grid[i];
        record.threadgroup[i] = d.threadgroup[i];
      }
      record.threadgroup_memory_length = d.threadgroup_memory_length;
      records->push_back(std::move(record));
    }
  }
  return "";
}

}  // namespace msl::emu
