#pragma once
// Entry header of the NCCL backend (device memory): link the CMake target ddp::nccl.
#if !defined(DDP_HAS_NCCL)
#error "<ddp/nccl.hpp> needs CUDA and NCCL: link the CMake target ddp::nccl (it exists when CMake finds the CUDA toolkit and NCCL)"
#endif
#include "ddp/backends/nccl.hpp"
