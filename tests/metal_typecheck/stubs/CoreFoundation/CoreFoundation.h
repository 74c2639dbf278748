// Type-check stub (Linux).
#pragma once
typedef double CFTimeInterval;
typedef const struct __CFString* CFStringRef;
typedef const void* CFTypeRef;
