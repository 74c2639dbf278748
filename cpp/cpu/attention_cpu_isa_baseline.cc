// The baseline instantiation of the CPU attention kernels (see attention_cpu_impl.h).
// Compiled with the target's baseline flags (SSE2 on x86-64, NEON on arm64).
#define FATRAIN_ISA baseline
#include "attention_cpu_impl.h"
