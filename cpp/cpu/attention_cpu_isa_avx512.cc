// The avx512 instantiation of the CPU attention kernels (see attention_cpu_impl.h),
// with the bf16 pair path on vdpbf16ps, which runs only where the CPU reports
// avx512_bf16 (attention_cpu.cc). Compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx512dq -mfma -mf16c -mavx512bf16 -mprefer-vector-width=512;
// empty on other architectures.
#if defined(__x86_64__)
#define FATRAIN_ISA avx512
#define FATRAIN_BF16_DOT 1
#include "attention_cpu_impl.h"
#endif
