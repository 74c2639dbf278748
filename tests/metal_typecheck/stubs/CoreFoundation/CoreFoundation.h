// Type-check stub (Linux).
#pragma once
typedef double CFTimeInterval;
typedef const struct __CFString* CFStringRef;
typedef const void* CFTypeRef;
// What the host's GPU core-count lookup uses (cpp/metal/host/executor.cc),
// with Apple's types; the Metal stand-in implements the functions.
#include <stdint.h>
typedef unsigned char Boolean;
typedef long CFIndex;
typedef unsigned long CFTypeID;
typedef const struct __CFAllocator* CFAllocatorRef;
typedef const struct __CFNumber* CFNumberRef;
typedef const struct __CFDictionary* CFDictionaryRef;
typedef struct __CFDictionary* CFMutableDictionaryRef;
typedef CFIndex CFNumberType;
enum { kCFNumberSInt32Type = 3, kCFNumberSInt64Type = 4 };
#ifdef __cplusplus
extern "C" {
#endif
extern const CFAllocatorRef kCFAllocatorDefault;
CFTypeID CFGetTypeID(CFTypeRef cf);
CFTypeID CFNumberGetTypeID(void);
Boolean CFNumberGetValue(CFNumberRef number, CFNumberType theType, void* valuePtr);
void CFRelease(CFTypeRef cf);
CFStringRef __CFStringMakeConstantString(const char* cStr);
#ifdef __cplusplus
}
#endif
#define CFSTR(cStr) __CFStringMakeConstantString("" cStr "")
