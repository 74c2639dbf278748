// Checks the kernels' vectorised exp2 against double precision: vexp2<float>
// (the float32-exact polynomial, for probabilities that meet float32
// products and for the running max's rescale factors) and vexp2<uint32_t>
// (the shorter one, for probabilities rounded to bf16 pairs). Built by
// build_and_test.sh once with the TU's baseline flags and, on x86-64, once
// with the AVX2 flags and once with the AVX-512 flags, so that the generic,
// the vmaxps/vminps-clamped and the vrndscaleps/vscalefps forms of vexp2 are
// checked.
//
// Over x in [-126, 0] (the normal range the softmax reaches: every argument
// is a score minus its row's running max) the relative error must stay
// within each polynomial's bound; below -150 and at -inf the result must be +0.
#ifndef FATRAIN_ISA
#define FATRAIN_ISA exp2_test
#endif
#include "../attention_cpu_impl.h"

#include <cmath>
#include <cstdio>

namespace fatrain::cpu::FATRAIN_ISA {
namespace {

template <class Pk>
double max_rel_error(double* worst_x) {
  double worst = 0;
  *worst_x = 0;
  // 2^20 + 1 points spaced 126 / 2^20 apart, W at a time.
  const int64_t n = (int64_t(1) << 20) + 1;
  for (int64_t i = 0; i < n; i += W) {
    vf x;
    for (int k = 0; k < W; ++k) x[k] = static_cast<float>(-126.0 * double(imin(i + k, n - 1)) / double(n - 1));
    const vf y = vexp2<Pk>(x);
    for (int k = 0; k < W; ++k) {
      const double want = std::exp2(double(x[k]));
      const double err = std::fabs(double(y[k]) - want) / want;
      if (err > worst) {
        worst = err;
        *worst_x = x[k];
      }
    }
  }
  return worst;
}

bool underflows_to_zero() {
  vf x;
  // -inf (a query's first running max, masked scores) and finite x < -150.
  for (int k = 0; k < W; ++k) x[k] = k == 0 ? -kInf : -150.5f - 10.0f * float(k);
  const vf y1 = vexp2<float>(x), y2 = vexp2<uint32_t>(x);
  for (int k = 0; k < W; ++k)
    if (y1[k] != 0.0f || y2[k] != 0.0f) return false;
  return true;
}

// A NaN argument gives NaN (a NaN score must make its query's sums NaN).
bool keeps_nan() {
  vf x;
  for (int k = 0; k < W; ++k) x[k] = k % 2 ? __builtin_nanf("") : -1.0f;
  const vf y1 = vexp2<float>(x), y2 = vexp2<uint32_t>(x);
  for (int k = 0; k < W; ++k)
    if ((y1[k] != y1[k]) != (k % 2 == 1) || (y2[k] != y2[k]) != (k % 2 == 1)) return false;
  return true;
}

}  // namespace
}  // namespace fatrain::cpu::FATRAIN_ISA

int main() {
  using namespace fatrain::cpu::FATRAIN_ISA;
  // Bounds: the polynomials' float32 errors (9.2e-8 and 1.8e-7 measured) with
  // a little room; the bf16 one stays 2e4 times below bf16's rounding.
  struct {
    const char* name;
    double (*measure)(double*);
    double bound;
  } cases[] = {{"vexp2<float>", max_rel_error<float>, 1.5e-7},
               {"vexp2<uint32_t>", max_rel_error<uint32_t>, 2.5e-7}};
  int failed = 0;
  for (const auto& c : cases) {
    double at = 0;
    const double err = c.measure(&at);
    const bool ok = err <= c.bound;
    std::printf("%s %s: max relative error %.3g at x = %.6g (bound %.2g)\n", ok ? "ok  " : "FAIL",
                c.name, err, at, c.bound);
    failed += !ok;
  }
  const bool zero = underflows_to_zero();
  std::printf("%s 2^x for x < -150 and x = -inf is +0\n", zero ? "ok  " : "FAIL");
  failed += !zero;
  const bool nan = keeps_nan();
  std::printf("%s 2^NaN is NaN\n", nan ? "ok  " : "FAIL");
  failed += !nan;
  std::printf(failed ? "exp2: %d FAILED\n" : "exp2: ALL PASSED\n", failed);
  return failed ? 1 : 0;
}
