// Type-check stub (Linux), force-included before every file: the libdispatch
// types metal-cpp names, and <math.h> (INFINITY) as Apple's headers bring it.
#pragma once
#include <math.h>
typedef struct dispatch_data_s* dispatch_data_t;
typedef struct dispatch_queue_s* dispatch_queue_t;
