// The compiled part of ddp::ddp_compiled (see ddp/core/compiled.hpp): the built-in backends'
// factories and the default store, defined once for every translation unit that defines
// DDP_COMPILED.
#define DDP_COMPILED_IMPLEMENTATION 1
#include "ddp/ddp.hpp"
