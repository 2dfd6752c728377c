#pragma once
// The compiled-library option (as Asio's separate compilation): header-only by default; with
// DDP_COMPILED defined in every translation unit of a program (the CMake target
// ddp::ddp_compiled defines it and links the library), the built-in backends' factories, the
// default store and the non-template functions a program only calls (init_process_group, the
// launch environment, the launcher, checkpoints, the bulk random generators, error messages)
// are compiled once, in src/ddp_compiled.cpp, instead of in every file that includes
// <ddp/ddp.hpp>. Their headers then hold declarations only and leave out the headers that only
// the definitions need, and <ddp/ddp.hpp> leaves out the ring backend's headers (include
// <ddp/backends/ring.hpp> and the transports yourself to use them directly). The macro must be
// the same in every translation unit of a program.
//
//   DDP_DECLARATIONS_ONLY  1 where the out-of-line parts are only declared (a DDP_COMPILED user)
//   DDP_COMPILED_INLINE    `inline` in headers, nothing in the one file that defines them

#if defined(DDP_COMPILED) && !defined(DDP_COMPILED_IMPLEMENTATION)
#define DDP_DECLARATIONS_ONLY 1
#else
#define DDP_DECLARATIONS_ONLY 0
#endif

#if defined(DDP_COMPILED_IMPLEMENTATION)
#define DDP_COMPILED_INLINE
#else
#define DDP_COMPILED_INLINE inline
#endif
