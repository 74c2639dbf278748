// The avx512 instantiation of the CPU attention kernels (see attention_cpu_impl.h).
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c
// -mavx512bf16 -mprefer-vector-width=512; empty on other architectures.
#if defined(__x86_64__)
#define FATRAIN_ISA avx512
#include "attention_cpu_impl.h"
#endif
