// The avx2 kernels with the bf16 pair path of the avx512_bf16 kernels, its
// dot product emulated with AVX2 FMAs (see Lanes<uint32_t> in
// kernels/vectors.h): a test instrument that runs that data flow on CPUs
// without avx512_bf16, chosen only by JAX_FATRAIN_CPU_ISA=avx2_bf16_emulated.
// Compiled with -mavx2 -mfma -mf16c; empty on other architectures.
#if defined(__x86_64__)
#define FATRAIN_ISA avx2_bf16_emulated
#define FATRAIN_BF16_DOT 2
#include "attention_cpu_impl.h"
#endif
