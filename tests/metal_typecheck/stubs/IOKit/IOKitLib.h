// Type-check stub (Linux): the IOKit calls of the host's GPU core-count
// lookup (cpp/metal/host/executor.cc), with Apple's types; the Metal
// stand-in implements them.
#pragma once
#include <CoreFoundation/CoreFoundation.h>
#include <mach/mach.h>
#include <stdint.h>
typedef mach_port_t io_object_t;
typedef io_object_t io_registry_entry_t;
typedef io_object_t io_service_t;
typedef uint32_t IOOptionBits;
#define IO_OBJECT_NULL ((io_object_t)0)
#ifdef __cplusplus
extern "C" {
#endif
CFMutableDictionaryRef IORegistryEntryIDMatching(uint64_t entryID);
io_service_t IOServiceGetMatchingService(mach_port_t mainPort, CFDictionaryRef matching);
CFTypeRef IORegistryEntryCreateCFProperty(io_registry_entry_t entry, CFStringRef key,
                                          CFAllocatorRef allocator, IOOptionBits options);
kern_return_t IOObjectRelease(io_object_t object);
#ifdef __cplusplus
}
#endif
