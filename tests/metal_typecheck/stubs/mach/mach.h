// Type-check stub (Linux).
#pragma once
typedef int kern_return_t;
typedef unsigned int task_id_token_t;
typedef unsigned int mach_port_t;
#define MACH_PORT_NULL 0
