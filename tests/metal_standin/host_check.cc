// The macOS Metal host without Python: the stand-in's self-test, then a
// forward and a backward per head dim (64, 128, 256) through
// cpp/metal/host/executor.cc (metal-cpp message sends into the stand-in,
// whose GPU is the MSL emulator), each checked two ways:
//   * bit for bit against the same plan run directly on the emulator
//     (msl::emu::execute_plan, the `metal_emulated` path) in this process,
//     as tests/test_metal_standin.py checks `metal` against
//     `metal_emulated`;
//   * against the double-precision reference of cpp/testing/attention_check.h
//     (the CPU and CUDA kernels' check), so an emulator that computed
//     wrongly on this machine would not pass unseen.
// Built and run for aarch64 under qemu by tools/arm64_check.sh metal, the
// path a Mac runs (metal-cpp's arm64 message sends,
// objc_msgsend_aarch64.S); it builds on x86-64 the same way.
//
//   host_check [CASE...]   the default cases below, or the
//                          standard_cases() named (no bias or mask: the
//                          Python side folds those before the host sees them)
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "metal/host/executor.h"
#include "metal/plan/plan.h"
#include "metal/plan/role_buffers.h"
#include "msl_emulator/plan_executor.h"
#include "testing/attention_check.h"

extern "C" const char fatrain_standin_library_source[];
extern "C" const char fatrain_standin_library_source_end[];
extern "C" const char* fatrain_metal_standin_selftest();
extern "C" const char* fatrain_metal_standin_report();

using namespace fatrain::testing;
using fatrain::AttentionProblem;
using fatrain::BackwardOperands;
using fatrain::BiasGradOperands;
using fatrain::DType;
using fatrain::ForwardOperands;
using fatrain::SeqTensor;
namespace mp = fatrain::metal_plan;

namespace {

size_t seq_bytes(const AttentionProblem& p, int64_t len, int64_t heads, DType dt) {
  return size_t(p.batch * len * heads * p.head_dim) * dsize(dt);
}

mp::Strides strides(const SeqTensor& t) {
  mp::Strides s;
  s.batch = t.batch_stride;
  s.head = t.head_stride;
  s.seq = t.seq_stride;
  return s;
}

// The problem the Metal FFI handlers build from the same operands
// (cpp/ffi/metal_ffi_common.h: BuildProblem).
std::string metal_problem(const AttentionProblem& a, const SeqTensor& q, const SeqTensor& k,
                          const SeqTensor& v, mp::Problem* p) {
  if (a.bias.data != nullptr || a.mask.data != nullptr)
    return "host_check: bias and mask are folded by the Python side; pick another case";
  static_cast<AttentionProblem&>(*p) = a;
  p->dtype = q.dtype;
  p->q = strides(q);
  p->k = strides(k);
  p->v = strides(v);
  p->o = p->q;
  return mp::validate(*p);
}

// The optional operands by role, as SetOptional in metal_ffi_common.h.
void set_optional(const AttentionProblem& a, mp::RoleBuffers* m) {
  const size_t b = size_t(a.batch) * 4;
  if (a.q_lengths) m->set(mp::Role::kQLengths, const_cast<int32_t*>(a.q_lengths), b);
  if (a.kv_lengths) m->set(mp::Role::kKVLengths, const_cast<int32_t*>(a.kv_lengths), b);
  if (a.q_segment_ids) {
    m->set(mp::Role::kQSegmentIds, const_cast<int32_t*>(a.q_segment_ids), b * a.q_len);
    m->set(mp::Role::kKVSegmentIds, const_cast<int32_t*>(a.kv_segment_ids), b * a.kv_len);
  }
}

// Runs `plan` through the host, then on the emulator directly with the
// outputs redirected to copies, and compares the outputs byte for byte.
std::string run_both(const mp::Problem& p, const mp::Plan& plan, const mp::RoleBuffers& host,
                     int* dispatches) {
  std::string err = fatrain::metal::execute(p, plan, host, /*poison_outputs=*/true);
  if (!err.empty()) return "host: " + err;
  msl::emu::RoleMemory emu;
  std::vector<std::vector<uint8_t>> copies;
  for (int r = 0; r < 16; ++r) {
    emu.data[r] = host.data[r];
    emu.size[r] = host.size[r];
    if (host.output[r] && host.data[r] != nullptr) {
      copies.emplace_back(host.size[r], uint8_t(0xFF));
      emu.data[r] = copies.back().data();
    }
  }
  err = msl::emu::execute_plan(p, plan, emu, msl::rt::ParallelFor());
  if (!err.empty()) return "emulator: " + err;
  for (int r = 0; r < 16; ++r) {
    if (host.output[r] && host.data[r] != nullptr &&
        std::memcmp(host.data[r], emu.data[r], host.size[r]) != 0) {
      return std::string("the host's ") + mp::role_name(mp::Role(r)) +
             " differs from the emulator's bit for bit";
    }
  }
  *dispatches += int(plan.dispatches.size());
  return "";
}

class MetalHostBackend : public Backend {
 public:
  int dispatches = 0;

  // tests/attention_cases.py's tolerances for the GPU kernels (as the CUDA
  // check uses).
  Tolerance tolerance(DType d) const override {
    if (d == DType::kF32) return {1e-4, 1e-4, 2e-4, 4e-4};
    if (d == DType::kBF16) return {1.5e-2, 2e-2, 3e-2, 6e-2};
    return {5e-3, 2e-2, 1e-2, 2e-2};
  }
  // Reruns are compared bit for bit with the first: the backward is deterministic.
  int backward_reruns() const override { return 1; }

  const char* forward(const AttentionProblem& a, const ForwardOperands& ops) override {
    mp::Problem p;
    mp::Plan plan;
    if (fail(metal_problem(a, ops.q, ops.k, ops.v, &p)) || fail(mp::plan_forward(p, &plan)))
      return error_.c_str();
    mp::RoleBuffers m;
    m.set(mp::Role::kQ, ops.q.data, seq_bytes(a, a.q_len, a.q_heads, p.dtype));
    m.set(mp::Role::kK, ops.k.data, seq_bytes(a, a.kv_len, a.kv_heads, p.dtype));
    m.set(mp::Role::kV, ops.v.data, seq_bytes(a, a.kv_len, a.kv_heads, p.dtype));
    m.set(mp::Role::kO, ops.o.data, seq_bytes(a, a.q_len, a.q_heads, p.dtype), true);
    m.set(mp::Role::kL, ops.lse, size_t(a.batch * a.q_heads * a.q_len) * 4, true);
    set_optional(a, &m);
    return fail(run_both(p, plan, m, &dispatches)) ? error_.c_str() : nullptr;
  }

  const char* backward(const AttentionProblem& a, const BackwardOperands& ops, int) override {
    mp::Problem p;
    mp::Plan plan;
    // Planned for the device's core count, as the FFI handler plans it.
    mp::BackwardOptions options;
    options.gpu_cores = fatrain::metal::gpu_core_count();
    if (fail(metal_problem(a, ops.q, ops.k, ops.v, &p)) ||
        fail(mp::plan_backward(p, &plan, options)))
      return error_.c_str();
    const size_t qb = seq_bytes(a, a.q_len, a.q_heads, p.dtype);
    const size_t kb = seq_bytes(a, a.kv_len, a.kv_heads, p.dtype);
    mp::RoleBuffers m;
    m.set(mp::Role::kQ, ops.q.data, qb);
    m.set(mp::Role::kK, ops.k.data, kb);
    m.set(mp::Role::kV, ops.v.data, kb);
    m.set(mp::Role::kO, ops.o.data, qb);
    m.set(mp::Role::kL, const_cast<float*>(ops.lse), size_t(a.batch * a.q_heads * a.q_len) * 4);
    m.set(mp::Role::kDO, ops.d_o.data, qb);
    m.set(mp::Role::kDQ, ops.dq.data, qb, true);
    m.set(mp::Role::kDK, ops.dk.data, kb, true);
    m.set(mp::Role::kDV, ops.dv.data, kb, true);
    set_optional(a, &m);
    return fail(run_both(p, plan, m, &dispatches)) ? error_.c_str() : nullptr;
  }

  const char* bias_grad(const AttentionProblem&, const BiasGradOperands&, int) override {
    return "host_check: the bias gradient runs on the CPU kernels, not the Metal host";
  }

 private:
  std::string error_;
  bool fail(const std::string& e) {
    error_ = e;
    return !e.empty();
  }
};

// A forward and a backward per compiled head dim, in each element type, with
// GQA, causal and not, lengths and sequence lengths off the tile sizes.
std::vector<Case> default_cases() {
  std::vector<Case> cs;
  auto add = [&](const char* name, int64_t D, DType dt, bool causal, bool lens) {
    Case c;
    c.name = name;
    c.B = 2; c.N = 4; c.K = 2; c.T = 45; c.S = 37; c.D = D; c.dt = dt;
    c.causal = causal;
    c.qlens = c.kvlens = lens;
    cs.push_back(c);
  };
  add("host_causal_gqa2_d64_f32", 64, DType::kF32, true, false);
  add("host_gqa2_d128_bf16_lengths", 128, DType::kBF16, false, true);
  add("host_causal_gqa2_d256_f16", 256, DType::kF16, true, false);
  return cs;
}

}  // namespace

int main(int argc, char** argv) {
  // The stand-in's own checks (message sends of every argument kind, API
  // misuse reported), as tests/test_metal_standin.py runs them.
  const std::string selftest = fatrain_metal_standin_selftest();
  std::printf("stand-in self-test: %s", selftest.c_str());
  check(selftest.rfind("failures 0\n", 0) == 0, "the stand-in self-test");

  const std::string source(fatrain_standin_library_source,
                           fatrain_standin_library_source_end - fatrain_standin_library_source);
  if (!check(fatrain::metal::unsupported_reason().empty(), "the stand-in's device is supported") ||
      !check(fatrain::metal::initialize(source, "").empty(), "the host's initialize")) {
    std::printf("FAILED: %d check(s)\n", failures());
    return 1;
  }
  std::printf("device: %s\n", fatrain::metal::device_name().c_str());

  std::vector<Case> cases;
  if (argc == 1) {
    cases = default_cases();
  } else {
    for (const Case& c : standard_cases())
      for (int i = 1; i < argc; ++i)
        if (c.name == argv[i]) cases.push_back(c);
    check(cases.size() == size_t(argc - 1), "every case named exists");
  }
  MetalHostBackend backend;
  for (const Case& c : cases) run_case(c, backend);
  check(backend.dispatches > 0, "dispatches ran through the host");

  // No finding: nothing the host did would be an error or a leak on a Mac.
  const std::string report = fatrain_metal_standin_report();
  const size_t at = report.find("\"findings\": [");
  check(at != std::string::npos && report.compare(at, 14, "\"findings\": []") == 0,
        "no stand-in findings: " + (at == std::string::npos ? report : report.substr(at)));
  std::printf("%d dispatches through the host, each bit for bit as on the emulator\n",
              backend.dispatches);
  if (failures()) {
    std::printf("FAILED: %d check(s)\n", failures());
    return 1;
  }
  std::printf("ALL PASSED\n");
  return 0;
}
