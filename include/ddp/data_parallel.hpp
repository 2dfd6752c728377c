#pragma once
// distributed_data_parallel: gradient synchronization over any parameter container.
//
//   ddp::distributed_data_parallel net{model, group};   // checks shapes across ranks, broadcasts rank 0
//   for (...) {
//     backward(model, [&](std::size_t i) { net.mark_ready(i); });   // bucket all-reduces overlap backward
//     net.finish();                                                 // wait; gradients are now the mean
//     step(model);
//   }
//
// What it does, and why:
//  - Construction checks the parameter count, shapes and dtypes across ranks (one all_gather of a
//    fingerprint; on a difference, a second one of per-parameter descriptors so that every rank can
//    name the first differing parameter on both sides), then broadcasts the values from rank 0 so
//    every replica starts from the same weights.
//  - Buckets are filled in reverse parameter order (backward produces the last layer's gradients
//    first), one dtype per bucket, the first capped at first_bucket_bytes (1 MiB: it starts
//    communicating early), the others at bucket_cap_bytes (25 MiB). As in PyTorch, a bucket is
//    closed once it reaches its cap, so it may exceed it by less than one parameter.
//  - Inside a bucket, gradients are laid out by ascending parameter index. Then a flat parameter
//    set (one gradient buffer, parameters in declaration order) makes every bucket a subspan of it,
//    and that bucket is reduced in place with no copy. Otherwise gradients are copied into a bucket
//    buffer (from group.allocate when the group has it: memory the backend may share) and back.
//  - Device memory (parameters in thrust::device_vector with a device backend such as nccl):
//    the same, with bucket buffers from group.allocate (device memory) filled and emptied by
//    group.copy_memory; the backend orders its collectives after the kernels that wrote the
//    gradients (see nccl_options::compute_stream).
//  - mark_ready(i) says parameter i's gradient is final. When a bucket's last gradient is ready its
//    asynchronous all-reduce (avg) starts at once, but only after every earlier bucket has started:
//    all ranks then issue the same collectives in the same order whatever order their backward
//    marks parameters in. The last bucket is the exception: once it is ready backward is over and
//    nothing is left to overlap it with, so finish() reduces it on the calling thread with the
//    group's blocking all_reduce. Handing it to the communication thread and waiting for it to
//    come back cost more than the whole reduction for small models (4x the step of the tutorial
//    MLP at 2 ranks on 2 cores). options.reduce_last_bucket_inline = false restores the hand-off.
//  - finish() starts what is left, waits for every bucket, copies back; after it the gradients are
//    the mean over ranks. A parameter never marked ready is an error naming it (PyTorch's
//    "Expected to have finished reduction" without the names), or a zero gradient with
//    options.find_unused_parameters. synchronize() = mark everything + finish().
//  - no_sync() returns a guard under which nothing is communicated (gradient accumulation): the
//    next synchronized step averages the accumulated sums.
//  - set_comm_hook(h): h(bucket_view, group) returns something with wait() and must leave the
//    bucket averaged once that wait() returns (ddp/compression.hpp: fp16_compress, bf16_compress).
//
// Parameters are listed once, at construction: their memory must stay where it is (do not resize
// the vectors behind them) for the life of the wrapper. mark_ready may be called from any thread
// (calls are serialized); finish(), synchronize() and no_sync() belong to the training loop.
//
// sharded_data_parallel (ddp/data_parallel/sharded_data_parallel.hpp) is ZeRO stage 1 and 2 over
// the same parameter containers and buckets: each rank keeps the optimizer state (and in stage 2
// the accumulated gradients) of one padded shard of every bucket, reduce-scatters the gradients
// and all-gathers the stepped parameters; bitwise what DDP + the same optimizer gives wherever
// the sums agree (see that header).
//
// This header only gathers the pieces: each is a header of its own in ddp/data_parallel/.

#include "ddp/data_parallel/any_work.hpp"
#include "ddp/data_parallel/bucket_plan.hpp"
#include "ddp/data_parallel/bucket_view.hpp"
#include "ddp/data_parallel/collective_group.hpp"
#include "ddp/data_parallel/distributed_data_parallel.hpp"
#include "ddp/data_parallel/group_traits.hpp"
#include "ddp/data_parallel/no_sync_guard.hpp"
#include "ddp/data_parallel/options.hpp"
#include "ddp/data_parallel/stats.hpp"
#include "ddp/data_parallel/waitable.hpp"
#include "ddp/parameters.hpp"
#include "ddp/data_parallel/sharded_data_parallel.hpp"
#include "ddp/data_parallel/join.hpp"
