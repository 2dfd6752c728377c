#pragma once
// ddp::checkpoint: save and resume a data-parallel training job, bit for bit.
//
//   ddp::checkpoint::state st;                          // built over the objects, just before save/load
//   st.add_parameters(model);                           // the parameter_refs DDP uses (host or device memory)
//   st.add("optim.momentum", std::span(momentum));      // optimizer state: any named span
//   st.add_generator("rng.dropout", gen);               // per-rank by default
//   st.sampler = {.seed = 0, .epoch = epoch, .batches_done = b};
//   ddp::checkpoint::save(group, "ckpt", step, st, {.keep = 3});
//   ...
//   std::int64_t found[1] = {-1};                      // rank 0 chooses, so that all ranks agree
//   if (group.rank() == 0) if (auto c = ddp::checkpoint::latest("ckpt")) found[0] = c->step;
//   group.broadcast(std::span(found), 0);
//   if (found[0] >= 0) ddp::checkpoint::load(ddp::checkpoint::step_path("ckpt", found[0]), group.rank(), group.size(), st);
//   for (auto batch : sampler.batches_from(batch_size, st.sampler.batches_done)) ...
//
// On disk, one directory per step, readable without ddp (safetensors + JSON):
//   ckpt/step-000000123/replicated.safetensors    what every rank holds alike (parameters, optimizer
//                                                 state), written by rank 0
//   ckpt/step-000000123/rank-00001.safetensors    what each rank holds alone (RNG states, its loss
//                                                 sums; ZeRO's optimizer shards will go here too)
//   ckpt/step-000000123/index.json                step, world size, sampler position, metadata,
//                                                 every file's size and CRC-32, every tensor's
//                                                 file, dtype and shape
//   ckpt/step-000000123/DONE                      written last: the checkpoint is complete
//
// Why it is built this way:
//  - Each file is written under a temporary name, fsynced and renamed, then the directory is
//    fsynced, so a file under its final name is whole. DONE is written by rank 0 only after every
//    rank's files are in place (an all_gather of their sizes and checksums is the barrier), and a
//    final barrier makes save() return on every rank only once DONE is durable: a rank that exits
//    right after save() (preemption) cannot have the launcher kill rank 0 mid-write.
//  - latest() returns the newest directory with DONE whose files all have the recorded size and
//    CRC-32; others are skipped with one line on stderr. So a crash at any point of a save (or a
//    file damaged later) falls back to the previous checkpoint.
//  - A complete checkpoint of the same step is not rewritten: a step names one state, and
//    rewriting would open a window in which it is incomplete. A partial directory of that step (a
//    crashed save) is removed first.
//  - keep > 0 removes complete checkpoints beyond the newest `keep` and partial ones older than
//    the newest complete one, after DONE (never before the new one is complete).
//  - load() compares what the caller's state expects with what the checkpoint holds (world size,
//    each tensor's presence, dtype and shape) and names every difference in one errc::config
//    error. Corrupted or unreadable files are errc::invalid_argument.
//  - A checkpoint of another world size (W saved, W' loading) is refused by default: per-rank
//    state (RNG streams, loss sums, ZeRO's optimizer shards) has no meaning for a rank that did
//    not write it. With load_options::allow_world_size_change it loads (elastic resume):
//      * replicated tensors (parameters, replicated optimizer state) load as usual: every rank
//        held the same values, so they reshard to any W';
//      * per-rank tensors are not loaded: they are left as they are and named in
//        loaded::not_loaded (a caller that wants rank r's records reads them with
//        load(ckpt, r, loaded::world_size, records));
//      * the sampler restarts the interrupted epoch: st.sampler = {seed, epoch, 0}, and
//        loaded::saved_sampler keeps what was saved. Why not continue mid-epoch: a
//        DistributedSampler gives rank r the positions r, r + W, ... of the epoch's permutation,
//        so the batches a W' job would still have to take are not a suffix of its own per-rank
//        sequences (and PyTorch's sampler has no position to continue from). Restarting the epoch
//        skips no sample; the finished steps of that epoch stay in the parameters, and their
//        samples are seen once more. Why not skip to the next epoch: it would leave samples of
//        that epoch unseen. Save at an epoch's end as {epoch + 1, 0} (after its last step), as
//        train_ddp does, so that a finished epoch is never repeated.
//    latest() reads every file of the checkpoints it checks: call it once, on one rank.
//  - CRC-32 (zlib's) rather than a cryptographic hash: it guards against torn and damaged files,
//    not against an adversary, and Python checks it with zlib.crc32 (the SHA-256 in store/detail
//    sits below the process group, where the training layer does not reach).
//  - A rank whose write fails (disk full) throws errc::internal; the others fail in save()'s next
//    collective (peer lost when that rank exits, else the group's deadline), and no checkpoint of
//    that step is marked complete.
//
// The directory must be visible to every rank under the same path (one host, or a shared file
// system).
// Parameters in device memory (thrust::device_vector, CUDA tensors) need the CUDA build: with it
// (DDP_HAS_NCCL, the ddp::nccl target) this header includes ddp/checkpoint/cuda.hpp, which copies
// them with cudaMemcpy straight into the file's bytes on save and out of them on load; the file is
// the same as for host memory, so a device-saved checkpoint loads into host memory and the other
// way round, and Python reads it alike. Without it they are refused with errc::invalid_argument
// (cuda.hpp says why ddp/checkpoint/state.hpp holds only a pointer to the copy functions).
//
// Test hook: DDP_CHECKPOINT_TEST_HOOK=ACTION:STEP:RANK:POINT[:FILE] makes that rank, while saving
// that step, SIGKILL itself (ACTION kill) or wait until FILE.go exists, it receives a signal of
// ddp::preemption or it is killed (pause),
// at POINT = tmp (its file fsynced under the temporary name, not renamed), done (rank 0:
// index.json in place, no DONE yet) or after (the checkpoint complete). With FILE the hook acts
// once per job (the rank that creates FILE), also across restarts. Tests interrupt at exact
// points with it instead of racing a timer.
//
// The pieces, in ddp/checkpoint/: state.hpp (what a checkpoint holds), save.hpp, load.hpp,
// directory.hpp (file names, index.json, verification, latest(), rotation), test_hook.hpp, and
// below them format.hpp (CRC-32, JSON, safetensors, durable writes) and preemption.hpp.

#include "ddp/checkpoint/directory.hpp"
#include "ddp/checkpoint/format.hpp"
#include "ddp/checkpoint/load.hpp"
#include "ddp/checkpoint/preemption.hpp"
#include "ddp/checkpoint/save.hpp"
#include "ddp/checkpoint/state.hpp"
#include "ddp/checkpoint/test_hook.hpp"

// The CUDA build saves and loads device memory (ddp/checkpoint/cuda.hpp says why it is apart).
#if defined(DDP_HAS_NCCL)
#include "ddp/checkpoint/cuda.hpp"
#endif
