// objc_msgSend for Linux aarch64, following Apple's arm64 rules where
// metal-cpp depends on them (docs/metal.md, "The stand-in on arm64").
//
// On arm64 there is one entry point: Apple's SDK has no objc_msgSend_stret
// or objc_msgSend_fpret there, and metal-cpp (built with __arm64__, see
// tests/metal_typecheck/stubs/apple_prelude.h) calls objc_msgSend for every
// message, cast to the method's exact C type. So the arguments sit in x0-x7
// (receiver, selector, then integers and pointers), v0-v7 (floating point and
// the members of homogeneous float aggregates) and on the stack (what does
// not fit, and composites larger than 16 bytes by reference in a register),
// and a result larger than 16 bytes, such as MTL::Size, is written to the
// memory x8 points to. The trampoline saves every one of those registers
// (x8 included), asks fatrain_objc_lookup(receiver, selector) for the
// implementation, restores them, pops its frame (so sp is the caller's and
// stack arguments are where the implementation expects them) and branches
// with x16 (IP0, which the AAPCS64 lets a veneer clobber) to the
// implementation, which then returns to the caller. x18 is not touched (the
// platform register on Apple's arm64). A message to nil returns 0 in x0, x1
// and v0-v3, as Apple's objc_msgSend does; memory behind x8 is left as is.

    .text

// objc_msgSend(receiver, selector, ...)
    .globl objc_msgSend
    .hidden objc_msgSend
    .type objc_msgSend, %function
    .p2align 4
objc_msgSend:
    .cfi_startproc
    cbz x0, 1f
    stp x29, x30, [sp, #-224]!
    .cfi_def_cfa_offset 224
    .cfi_offset x29, -224
    .cfi_offset x30, -216
    mov x29, sp
    stp x0, x1, [sp, #16]
    stp x2, x3, [sp, #32]
    stp x4, x5, [sp, #48]
    stp x6, x7, [sp, #64]
    str x8, [sp, #80]
    stp q0, q1, [sp, #96]
    stp q2, q3, [sp, #128]
    stp q4, q5, [sp, #160]
    stp q6, q7, [sp, #192]
    bl fatrain_objc_lookup          // (receiver, selector) already in x0, x1
    mov x16, x0
    ldp x0, x1, [sp, #16]
    ldp x2, x3, [sp, #32]
    ldp x4, x5, [sp, #48]
    ldp x6, x7, [sp, #64]
    ldr x8, [sp, #80]
    ldp q0, q1, [sp, #96]
    ldp q2, q3, [sp, #128]
    ldp q4, q5, [sp, #160]
    ldp q6, q7, [sp, #192]
    ldp x29, x30, [sp], #224
    .cfi_def_cfa_offset 0
    .cfi_restore x29
    .cfi_restore x30
    br x16
1:
    mov x1, #0
    movi v0.2d, #0
    movi v1.2d, #0
    movi v2.2d, #0
    movi v3.2d, #0
    ret
    .cfi_endproc
    .size objc_msgSend, .-objc_msgSend

    .section .note.GNU-stack,"",%progbits
