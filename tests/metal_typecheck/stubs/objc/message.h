// Linux stand-in for Apple's header: the message-send entry points metal-cpp
// uses (tests/metal_standin/objc_msgsend_{x86_64,aarch64}.S implement them).
// As in Apple's SDK, arm64 has no _fpret or _stret form, so a reference to
// one fails to compile there.
#pragma once
#include <objc/runtime.h>
#ifdef __cplusplus
extern "C" {
#endif
void objc_msgSend(void);
#if !defined(__arm64__)
void objc_msgSend_fpret(void);
void objc_msgSend_stret(void);
#endif
#ifdef __cplusplus
}
#endif
