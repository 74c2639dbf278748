// The avx2 instantiation of the CPU attention kernels (see attention_cpu_impl.h).
// Compiled with -mavx2 -mfma -mf16c; empty on other architectures.
#if defined(__x86_64__)
#define FATRAIN_ISA avx2
#include "attention_cpu_impl.h"
#endif
