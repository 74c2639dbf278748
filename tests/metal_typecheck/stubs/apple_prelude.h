// Type-check stub (Linux), force-included before every file: the libdispatch
// types metal-cpp names, and <math.h> (INFINITY) as Apple's headers bring it.
#pragma once
// Apple's compilers define __arm64__ on arm64, GCC and clang for Linux only
// __aarch64__; metal-cpp picks its message-send forms (no _stret or _fpret on
// arm64) by __arm64__, so an aarch64 build takes the path a Mac takes.
#if defined(__aarch64__) && !defined(__arm64__)
#define __arm64__ 1
#define __arm64 1
#endif
#include <math.h>
typedef struct dispatch_data_s* dispatch_data_t;
typedef struct dispatch_queue_s* dispatch_queue_t;
