// Type-check stub (Linux).
#pragma once
typedef struct __IOSurface* IOSurfaceRef;
