#pragma once
// ddp: collective communication and distributed data-parallel training, header-only.
// This entry header includes everything that needs only the C++ standard library and POSIX;
// <ddp/nccl.hpp> and <ddp/mpi.hpp> add the optional backends, <ddp/adapters/eigen.hpp> and
// <ddp/adapters/thrust.hpp> the parameter adapters for those libraries.

// With DDP_COMPILED (CMake target ddp::ddp_compiled) the ring backend is compiled once in the
// library and its headers are left out here; see ddp/core/compiled.hpp.

// core: errors, element types, reduce ops, deadlines, concepts, launch environment
#include "ddp/core/collective.hpp"
#include "ddp/core/compiled.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/env.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/core/version.hpp"

// rendezvous stores
#include "ddp/store/file_store.hpp"
#include "ddp/store/hash_store.hpp"
#include "ddp/store/store.hpp"
#if !DDP_DECLARATIONS_ONLY
#include "ddp/store/tcp_store.hpp"
#include "ddp/store/torch_tcp_store.hpp"

// transports, algorithms, the ring backend
#include "ddp/backends/ring/ring_communicator.hpp"
#include "ddp/backends/ring/shm_communicator.hpp"
#include "ddp/backends/ring.hpp"
#include "ddp/shared_buffer.hpp"
#include "ddp/backends/ring/transport/shm.hpp"
#include "ddp/backends/ring/transport/tcp.hpp"
#endif

// process groups
#include "ddp/group.hpp"
#include "ddp/init.hpp"
#include "ddp/process_group.hpp"
#include "ddp/work.hpp"

// training: generator, sampler, DDP wrapper, checkpoints and preemption
#include "ddp/checkpoint.hpp"
#include "ddp/compression.hpp"
#include "ddp/data_parallel.hpp"
#include "ddp/parameters.hpp"
#include "ddp/random.hpp"
#include "ddp/sampler.hpp"

// launching workers
#include "ddp/launch.hpp"
