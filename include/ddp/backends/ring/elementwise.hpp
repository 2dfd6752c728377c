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
