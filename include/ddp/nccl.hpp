#pragma once
// Entry header of the NCCL backend (device memory): link the CMake target ddp::nccl.
//
// Including it registers the backend "nccl" with init_process_group:
//   auto group = ddp::init_process_group("nccl");   // one GPU per local rank (LOCAL_RANK)
// The NCCL unique id travels through the job's store (tcp_store at MASTER_ADDR:MASTER_PORT).
#if !defined(DDP_HAS_NCCL)
#error "<ddp/nccl.hpp> needs CUDA and NCCL: link the CMake target ddp::nccl (it exists when CMake finds the CUDA toolkit and NCCL)"
#endif
#include "ddp/backends/nccl.hpp"
#include "ddp/init.hpp"
#include "ddp/store/hash_store.hpp"

namespace ddp {
namespace detail {

inline group pg_make_nccl(const backend_context& c) {
  // A world of one has no store; its unique id only needs to reach itself.
  store::hash_store local;
  store::store& rendezvous = c.store ? *c.store : static_cast<store::store&>(local);
  nccl_options options;
  options.local_rank = c.env.local_rank;
  options.key_prefix = c.prefix + "/nccl/";
  return group(process_group<nccl_backend>(nccl_backend(rendezvous, c.rank, c.world_size, options, deadline::after(c.options.init_timeout)),
                                           {.timeout = c.options.timeout}));
}

}  // namespace detail

inline const bool nccl_backend_registered = register_backend("nccl", detail::pg_make_nccl);

}  // namespace ddp
