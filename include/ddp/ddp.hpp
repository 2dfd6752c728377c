#pragma once
// ddp: collective communication and distributed data-parallel training, header-only.
// This entry header includes everything that needs only the C++ standard library and POSIX;
// <ddp/nccl.hpp> and <ddp/mpi.hpp> add the optional backends.

#include "ddp/core/concepts.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/core/version.hpp"
#include "ddp/store/hash_store.hpp"
#include "ddp/store/store.hpp"
