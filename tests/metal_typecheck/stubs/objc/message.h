// Type-check stub (Linux): message-send entry points used by metal-cpp.
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
