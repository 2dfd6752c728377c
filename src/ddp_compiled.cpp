// The compiled part of ddp::ddp_compiled (see ddp/core/compiled.hpp): the built-in backends'
// factories, the default store and every definition under !DDP_DECLARATIONS_ONLY, defined once
// for every translation unit that defines DDP_COMPILED.
#define DDP_COMPILED_IMPLEMENTATION 1
#include "ddp/ddp.hpp"

namespace ddp {

// Users of the compiled library see this function where header-only users see the template
// (ddp/init.hpp): the ring backend is instantiated here, once.
group init_process_group(std::string_view backend, init_options opts) { return init_process_group<>(backend, std::move(opts)); }

}  // namespace ddp
