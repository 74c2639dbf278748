// Linux stand-in for Apple's header: the message-send entry points metal-cpp
// uses (tests/metal_standin/objc_msgsend_x86_64.S implements them).
#pragma once
#include <objc/runtime.h>
#ifdef __cplusplus
extern "C" {
#endif
void objc_msgSend(void);
void objc_msgSend_fpret(void);
void objc_msgSend_stret(void);
#ifdef __cplusplus
}
#endif
