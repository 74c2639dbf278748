// The avx512 kernels with the bfloat16 tile products on AMX tiles
// (TDPBF16PS, see kernels/tile_products.h): the forward, and the backward
// where the head dim is a multiple of 32. They run only where the CPU reports
// amx_tile and amx_bf16 and the kernel grants this process AMX tile data
// (attention_cpu.cc); every other problem and pass of that variant runs on
// the avx512 kernels. Compiled with the avx512 flags and -mamx-tile
// -mamx-bf16; empty on other architectures.
#if defined(__x86_64__)
#define FATRAIN_ISA avx512_amx
#define FATRAIN_BF16_DOT 1
#define FATRAIN_AMX 1
#include "attention_cpu_impl.h"
#endif
