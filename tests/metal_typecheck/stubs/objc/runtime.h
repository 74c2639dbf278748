// Linux stand-in for Apple's header: just the Objective-C runtime
// declarations metal-cpp uses. tests/metal_standin implements them.
#pragma once
#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>
typedef struct objc_class* Class;
typedef struct objc_object { Class isa; }* id;
typedef struct objc_selector* SEL;
// BOOL is bool on Apple's arm64 (also macOS) and signed char on x86-64 macOS.
#if defined(__arm64__)
typedef bool BOOL;
#else
typedef signed char BOOL;
#endif
typedef struct objc_object Protocol;
#define YES ((BOOL)1)
#define NO ((BOOL)0)
#define nil nullptr
#ifdef __cplusplus
extern "C" {
#endif
SEL sel_registerName(const char* name);
id objc_lookUpClass(const char* name);
Protocol* objc_getProtocol(const char* name);
#ifdef __cplusplus
}
#endif
