#pragma once
// DDP_ELEMENTWISE_LOOP marks a loop over elements whose pointers may alias exactly (a destination
// that is a source at the same index, as in-place reductions do, never a shifted overlap): each
// element is read before it is written, so vector code is correct, but the compiler cannot prove
// it and would otherwise test the pointers at run time and run scalar code exactly when they alias.

#if defined(__CUDACC__)
#define DDP_ELEMENTWISE_LOOP
#elif defined(__clang__)
#define DDP_ELEMENTWISE_LOOP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define DDP_ELEMENTWISE_LOOP _Pragma("GCC ivdep")
#else
#define DDP_ELEMENTWISE_LOOP
#endif

// DDP_HOT_KERNEL puts a kernel's function out of line, starting on a 64-byte boundary: where its
// loops fall relative to the instruction fetch lines then depends on the kernel alone, not on
// what else the including file compiles, which otherwise changed the same all-reduce's speed from
// one build to the next (bench/README.md, "Kernel alignment").
#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define DDP_HOT_KERNEL [[gnu::noinline, gnu::aligned(64)]]
#else
#define DDP_HOT_KERNEL
#endif
