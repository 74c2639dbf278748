// objc_msgSend and its _stret / _fpret forms for Linux x86-64 (System V ABI).
//
// A message send is a call through objc_msgSend cast to the method's C type,
// so the arguments sit in rdi, rsi, rdx, rcx, r8, r9, xmm0-xmm7 (al: the
// vector register count of a variadic call) and on the stack (structs larger
// than 16 bytes, such as MTL::Size). The trampoline saves every argument
// register, asks fatrain_objc_lookup(receiver, selector) for the
// implementation, restores the registers, pops its frame and jumps: the
// implementation then sees exactly the caller's arguments and returns to the
// caller. A message to nil returns 0 (rax, rdx, xmm0, xmm1) as Objective-C
// does.

    .text

    .macro SAVE_ARGS
    push %rbp
    .cfi_def_cfa_offset 16
    .cfi_offset %rbp, -16
    mov %rsp, %rbp
    .cfi_def_cfa_register %rbp
    sub $192, %rsp
    mov %rdi, 0(%rsp)
    mov %rsi, 8(%rsp)
    mov %rdx, 16(%rsp)
    mov %rcx, 24(%rsp)
    mov %r8, 32(%rsp)
    mov %r9, 40(%rsp)
    mov %rax, 48(%rsp)
    movdqa %xmm0, 64(%rsp)
    movdqa %xmm1, 80(%rsp)
    movdqa %xmm2, 96(%rsp)
    movdqa %xmm3, 112(%rsp)
    movdqa %xmm4, 128(%rsp)
    movdqa %xmm5, 144(%rsp)
    movdqa %xmm6, 160(%rsp)
    movdqa %xmm7, 176(%rsp)
    .endm

    .macro RESTORE_ARGS_AND_JUMP
    mov %rax, %r11
    mov 0(%rsp), %rdi
    mov 8(%rsp), %rsi
    mov 16(%rsp), %rdx
    mov 24(%rsp), %rcx
    mov 32(%rsp), %r8
    mov 40(%rsp), %r9
    mov 48(%rsp), %rax
    movdqa 64(%rsp), %xmm0
    movdqa 80(%rsp), %xmm1
    movdqa 96(%rsp), %xmm2
    movdqa 112(%rsp), %xmm3
    movdqa 128(%rsp), %xmm4
    movdqa 144(%rsp), %xmm5
    movdqa 160(%rsp), %xmm6
    movdqa 176(%rsp), %xmm7
    leave
    .cfi_def_cfa %rsp, 8
    jmp *%r11
    .endm

// objc_msgSend(receiver, selector, ...)
    .globl objc_msgSend
    .hidden objc_msgSend
    .type objc_msgSend, @function
    .p2align 4
objc_msgSend:
    .cfi_startproc
    test %rdi, %rdi
    jz 1f
    SAVE_ARGS
    call fatrain_objc_lookup          // (receiver, selector) already in rdi, rsi
    RESTORE_ARGS_AND_JUMP
1:
    xor %eax, %eax
    xor %edx, %edx
    pxor %xmm0, %xmm0
    pxor %xmm1, %xmm1
    ret
    .cfi_endproc
    .size objc_msgSend, .-objc_msgSend

// objc_msgSend_fpret: float and double results come back in xmm0 as with any
// call, so this is objc_msgSend (the form matters only for long double).
    .globl objc_msgSend_fpret
    .hidden objc_msgSend_fpret
    .type objc_msgSend_fpret, @function
    .p2align 4
objc_msgSend_fpret:
    .cfi_startproc
    jmp objc_msgSend
    .cfi_endproc
    .size objc_msgSend_fpret, .-objc_msgSend_fpret

// objc_msgSend_stret(result, receiver, selector, ...): a struct result larger
// than 16 bytes is written through the hidden first argument.
    .globl objc_msgSend_stret
    .hidden objc_msgSend_stret
    .type objc_msgSend_stret, @function
    .p2align 4
objc_msgSend_stret:
    .cfi_startproc
    test %rsi, %rsi
    jz 1f
    SAVE_ARGS
    mov %rsi, %rdi
    mov %rdx, %rsi
    call fatrain_objc_lookup
    RESTORE_ARGS_AND_JUMP
1:
    mov %rdi, %rax
    ret
    .cfi_endproc
    .size objc_msgSend_stret, .-objc_msgSend_stret

    .section .note.GNU-stack,"",@progbits
