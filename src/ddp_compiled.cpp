// The compiled part of ddp::ddp_compiled (see ddp/core/compiled.hpp): the built-in backends'
// factories, the default store and every definition under !DDP_DECLARATIONS_ONLY, defined once
// for every translation unit that defines DDP_COMPILED.
#define DDP_COMPILED_IMPLEMENTATION 1
#include "ddp/ddp.hpp"
