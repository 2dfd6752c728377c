#pragma once
// ddp::nccl_backend: collectives on device memory through NCCL, modelling ddp::backend.
//
// - one device per local rank (cudaSetDevice(local_rank)); fewer visible devices than local
//   ranks is errc::cuda saying so;
// - the communicator is set up through the process group's store: rank 0 creates the
//   ncclUniqueId and publishes it; it is created non-blocking (config.blocking = 0), so no
//   NCCL call can hang the host;
// - operations run on the backend's own stream, ordered after the work already queued on the
//   compute stream (nccl_options::compute_stream, by default the legacy default stream that
//   Thrust and cuBLAS use unless told otherwise) through an event, so gradients produced by
//   kernels still running are complete before NCCL reads them;
// - a call returns when its stream work is complete (a CUDA event recorded after it; an async
//   call's work handle completes then); waiting polls the event and ncclCommGetAsyncError, and
//   a deadline that passes aborts the communicator (ncclCommAbort), so a dead peer is an
//   error, not a hang;
// - spans may also point to host memory (DDP's shape check, a loss to average): such operands
//   are staged through a device buffer the backend keeps, so every process_group call works;
// - every CUDA and NCCL return code is checked and reported with its error string and
//   ncclGetLastError's text.
//
// ddp::float16 / ddp::bfloat16 have the device types' bit layout and map to ncclFloat16 /
// ncclBfloat16 (NCCL accumulates them itself).
//
// NCCL takes the element type and the reduction at run time, so the backend takes every call as
// one record (takes_call_records): its typed forms only build the record, and nothing below
// them is compiled once per element type or collective.

#if !defined(DDP_HAS_NCCL)
#error "<ddp/backends/nccl.hpp> needs CUDA and NCCL: link the CMake target ddp::nccl (found when CUDA and NCCL are installed)"
#endif

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ddp/backends/cuda_memory.hpp"
#include "ddp/core/collective.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/function_ref.hpp"
#include "ddp/core/reduce_op.hpp"
#include "ddp/store/store.hpp"

namespace ddp {

namespace detail {

/// Throws errc::nccl naming the call and NCCL's text for the code (plus ncclGetLastError's).
/// ncclInProgress is not an error: a non-blocking communicator is still working.
inline void nccl_check(ncclResult_t code, const char* call, ncclComm_t comm = nullptr, const error_context& context = {}) {
  if (code == ncclSuccess || code == ncclInProgress) return;
  error_context c = context;
  c.backend_code = static_cast<int>(code);
  std::string text = std::string(call) + " failed: " + ncclGetErrorString(code);
  if (const char* last = ncclGetLastError(comm); last != nullptr && *last != '\0') text += " (" + std::string(last) + ")";
  if (code == ncclSystemError) text += "; if this runs in a container, a small /dev/shm is a common cause (use --ipc=host or --shm-size)";
  throw error(errc::nccl, text, std::move(c));
}

constexpr ncclDataType_t nccl_datatype(dtype type) noexcept {
  switch (type) {
    case dtype::float32: return ncclFloat32;
    case dtype::float64: return ncclFloat64;
    case dtype::float16: return ncclFloat16;
    case dtype::bfloat16: return ncclBfloat16;
    case dtype::int32: return ncclInt32;
    case dtype::int64: return ncclInt64;
    case dtype::uint8: break;
  }
  return ncclUint8;
}

constexpr ncclRedOp_t nccl_op(reduce_kind kind) noexcept {
  switch (kind) {
    case reduce_kind::sum: return ncclSum;
    case reduce_kind::avg: return ncclAvg;
    case reduce_kind::min: return ncclMin;
    case reduce_kind::max: return ncclMax;
    case reduce_kind::prod: break;
  }
  return ncclProd;
}

/// The arguments of the NCCL call(s) for one collective record in a world of `size`: the
/// elements each call moves (all_to_all: per peer), their type, the reduction, and the root
/// (send, recv: the peer).
struct nccl_arguments {
  std::size_t count = 0;
  ncclDataType_t type = ncclUint8;
  ncclRedOp_t op = ncclSum;
  int root = -1;
};
constexpr nccl_arguments nccl_arguments_of(const collective_call& c, int size) noexcept {
  std::size_t count = c.out_count;
  switch (c.op) {
    case collective::all_gather:
    case collective::send: count = c.in_count; break;
    case collective::all_to_all: count = size > 0 ? c.in_count / static_cast<std::size_t>(size) : 0; break;
    default: break;
  }
  return {count, nccl_datatype(c.type), nccl_op(c.reduction), c.root};
}

/// Rank 0 makes the unique id (make_id()) and publishes it under `key`; the others read it
/// (store::get waits for it, up to the store's timeout).
template <class MakeId>
ncclUniqueId share_unique_id(store::store& rendezvous, int rank, const std::string& key, MakeId&& make_id) {
  ncclUniqueId id;
  if (rank == 0) {
    id = make_id();
    rendezvous.set(key, std::as_bytes(std::span(id.internal)));
    return id;
  }
  const auto bytes = rendezvous.get(key);
  if (bytes.size() != sizeof id.internal) {
    throw error(errc::store, "store key '" + key + "' holds " + std::to_string(bytes.size()) + " bytes, not an NCCL unique id (" +
                                 std::to_string(sizeof id.internal) + " bytes): another job or an older program uses this prefix",
                {.rank = rank, .op = "nccl init"});
  }
  std::memcpy(id.internal, bytes.data(), sizeof id.internal);
  return id;
}

}  // namespace detail

struct nccl_options {
  int local_rank = 0;                          // selects the device
  std::string key_prefix = "ddp/nccl/";        // where rank 0 publishes the unique id
  bool check_collectives = true;               // agree on each call's fingerprint (one 16-byte all-reduce ahead of it)
  cudaStream_t compute_stream = cudaStreamLegacy;  // collectives start after the work queued here
};

class nccl_backend {
 public:
  static constexpr std::string_view name = "nccl";
  static constexpr memory_space memory = memory_space::device;
  /// Reducing collectives take a ddp::runtime_op as well as the static ops (ddp::group uses it).
  static constexpr bool runtime_reductions = true;
  /// process_group hands every call to run() as one record.
  static constexpr bool takes_call_records = true;
  /// Every collective, each with the call's fingerprint and deadline.
  static constexpr backend_capabilities capabilities = all_capabilities;
  static constexpr bool natively_async = true;

  nccl_backend(store::store& rendezvous, int rank, int size, nccl_options options = {},
               deadline until = deadline::after(default_timeout()))
      : rank_(rank), size_(size), options_(std::move(options)) {
    const error_context context{.rank = rank, .op = "nccl init"};
    int devices = 0;
    detail::cuda_check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount", context);
    if (options_.local_rank >= devices) {
      throw error(errc::cuda,
                  "local rank " + std::to_string(options_.local_rank) + " needs device " + std::to_string(options_.local_rank) +
                      " but only " + std::to_string(devices) +
                      " CUDA device(s) are visible (check CUDA_VISIBLE_DEVICES and --nproc-per-node)",
                  context);
    }
    device_ = options_.local_rank;
    detail::cuda_check(cudaSetDevice(device_), "cudaSetDevice", context);
    detail::cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", context);
    detail::cuda_check(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming), "cudaEventCreateWithFlags", context);
    detail::cuda_check(cudaEventCreateWithFlags(&completed_, cudaEventDisableTiming), "cudaEventCreateWithFlags", context);
    detail::cuda_check(cudaMalloc(reinterpret_cast<void**>(&fingerprint_), 2 * sizeof(std::uint64_t)), "cudaMalloc", context);

    const ncclUniqueId id = detail::share_unique_id(rendezvous, rank, options_.key_prefix + "unique_id", [] {
      ncclUniqueId made;
      detail::nccl_check(ncclGetUniqueId(&made), "ncclGetUniqueId");
      return made;
    });
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    detail::nccl_check(ncclCommInitRankConfig(&comm_, size, id, rank, &config), "ncclCommInitRankConfig", comm_, context);
    wait_comm_ready({.known = &context}, until);
  }

  nccl_backend(const nccl_backend&) = delete;
  nccl_backend& operator=(const nccl_backend&) = delete;
  // Movable so that a process_group can own it; the moved-from backend holds nothing.
  nccl_backend(nccl_backend&& other) noexcept
      : rank_(other.rank_), size_(other.size_), device_(other.device_), options_(std::move(other.options_)),
        stream_(std::exchange(other.stream_, nullptr)), inputs_ready_(std::exchange(other.inputs_ready_, nullptr)),
        completed_(std::exchange(other.completed_, nullptr)),
        comm_(std::exchange(other.comm_, nullptr)), fingerprint_(std::exchange(other.fingerprint_, nullptr)),
        staging_(std::move(other.staging_)), seq_(other.seq_), aborted_(other.aborted_.load()) {}
  nccl_backend& operator=(nccl_backend&&) = delete;

  ~nccl_backend() {
    if (stream_ != nullptr) cudaSetDevice(device_);
    if (comm_ != nullptr) {
      if (aborted_.load()) {
        ncclCommAbort(comm_);
      } else {
        ncclCommFinalize(comm_);
        ncclResult_t state = ncclInProgress;
        const auto until = deadline::after(std::chrono::seconds(10));
        while (state == ncclInProgress && !until.expired()) ncclCommGetAsyncError(comm_, &state);
        if (state == ncclSuccess) ncclCommDestroy(comm_);
        else ncclCommAbort(comm_);
      }
    }
    staging_ = {};
    if (fingerprint_ != nullptr) cudaFree(fingerprint_);
    if (inputs_ready_ != nullptr) cudaEventDestroy(inputs_ready_);
    if (completed_ != nullptr) cudaEventDestroy(completed_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  int device() const noexcept { return device_; }
  cudaStream_t stream() const noexcept { return stream_; }
  ncclComm_t communicator() const noexcept { return comm_; }

  /// n elements of this backend's device memory (process_group::allocate; DDP's bucket buffers).
  template <dtype_like T>
  device_buffer<T> allocate(std::size_t n) {
    detail::cuda_check(cudaSetDevice(device_), "cudaSetDevice", {.rank = rank_});
    return device_buffer<T>(n);
  }
  /// Copies bytes between any two buffers the device can reach or the host (cudaMemcpyDefault);
  /// returns when the copy is complete. Ordered after the work already queued on the legacy
  /// default stream, as every cudaMemcpy is.
  void copy_memory(void* dst, const void* src, std::size_t bytes) {
    if (bytes == 0 || dst == src) return;
    detail::cuda_check(cudaSetDevice(device_), "cudaSetDevice", {.rank = rank_});
    detail::cuda_check(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy", {.rank = rank_});
  }

  // --- the plain backend interface ---------------------------------------------------
  template <dtype_like T, any_reduce_op Op>
  void all_reduce(std::span<T> data, Op op) { all_reduce(data, op, next<T>(collective::all_reduce, data.size(), kind_of(op)), default_deadline()); }
  template <dtype_like T>
  void broadcast(std::span<T> data, int root) {
    broadcast(data, root, next<T>(collective::broadcast, data.size(), reduce_kind::sum, root), default_deadline());
  }
  template <dtype_like T>
  void all_gather(std::span<const T> in, std::span<T> out) { all_gather(in, out, next<T>(collective::all_gather, in.size()), default_deadline()); }
  template <dtype_like T, any_reduce_op Op>
  void reduce_scatter(std::span<const T> in, std::span<T> out, Op op) {
    reduce_scatter(in, out, op, next<T>(collective::reduce_scatter, out.size(), kind_of(op)), default_deadline());
  }
  void barrier() { barrier(next<std::uint8_t>(collective::barrier, 0), default_deadline()); }

  // --- with the group's fingerprint and deadline (the extended interface) --------------
  template <dtype_like T, any_reduce_op Op>
  void all_reduce(std::span<T> data, Op op, const collective_desc& desc, deadline until) {
    run(collective_call::of(collective::all_reduce, data, data, kind_of(op)), desc, until);
  }
  template <dtype_like T>
  void broadcast(std::span<T> data, int root, const collective_desc& desc, deadline until) {
    run(collective_call::of(collective::broadcast, data, data, reduce_kind::sum, root), desc, until);
  }
  template <dtype_like T, any_reduce_op Op>
  void reduce(std::span<T> data, int root, Op op, const collective_desc& desc, deadline until) {
    run(collective_call::of(collective::reduce, data, data, kind_of(op), root), desc, until);
  }
  template <dtype_like T>
  void all_gather(std::span<const T> in, std::span<T> out, const collective_desc& desc, deadline until) {
    run(collective_call::of(collective::all_gather, in, out), desc, until);
  }
  template <dtype_like T, any_reduce_op Op>
  void reduce_scatter(std::span<const T> in, std::span<T> out, Op op, const collective_desc& desc, deadline until) {
    run(collective_call::of(collective::reduce_scatter, in, out, kind_of(op)), desc, until);
  }
  template <dtype_like T>
  void all_to_all(std::span<const T> in, std::span<T> out, const collective_desc& desc, deadline until) {
    run(collective_call::of(collective::all_to_all, in, out), desc, until);
  }
  void barrier(const collective_desc& desc, deadline until) { run(collective_call{.op = collective::barrier}, desc, until); }
  template <dtype_like T>
  void send(std::span<const T> data, int peer, const collective_desc& desc, deadline until) {
    run(collective_call::of(collective::send, data, std::span<T>(), reduce_kind::sum, peer), desc, until);
  }
  template <dtype_like T>
  void recv(std::span<T> data, int peer, const collective_desc& desc, deadline until) {
    run(collective_call::of(collective::recv, std::span<const T>(), data, reduce_kind::sum, peer), desc, until);
  }
  template <dtype_like T>
  void send(std::span<const T> data, int peer) { send(data, peer, collective_desc{.op = collective::send, .type = dtype_of<T>, .count = data.size()}, default_deadline()); }
  template <dtype_like T>
  void recv(std::span<T> data, int peer) { recv(data, peer, collective_desc{.op = collective::recv, .type = dtype_of<T>, .count = data.size()}, default_deadline()); }

  /// One collective as a record (process_group has checked it; in place for all_reduce,
  /// broadcast and reduce). Collectives first agree on the fingerprint; send and recv do not.
  void run(const collective_call& c, const collective_desc& desc, deadline until) {
    const detail::nccl_arguments a = detail::nccl_arguments_of(c, size_);
    const operand in{c.in, nullptr, c.in_bytes()}, out{nullptr, c.out, c.out_bytes()}, in_out{c.out, c.out, c.out_bytes()};
    switch (c.op) {
      case collective::all_reduce:
        return run_checked(desc, until, {in_out}, [&](void* const* p) { return ncclAllReduce(p[0], p[0], a.count, a.type, a.op, comm_, stream_); });
      case collective::broadcast:
        return run_checked(desc, until, {in_out}, [&](void* const* p) { return ncclBroadcast(p[0], p[0], a.count, a.type, a.root, comm_, stream_); });
      case collective::reduce:
        return run_checked(desc, until, {in_out},
                           [&](void* const* p) { return ncclReduce(p[0], p[0], a.count, a.type, a.op, a.root, comm_, stream_); });
      case collective::all_gather:
        return run_checked(desc, until, {in, out}, [&](void* const* p) { return ncclAllGather(p[0], p[1], a.count, a.type, comm_, stream_); });
      case collective::reduce_scatter:
        return run_checked(desc, until, {in, out},
                           [&](void* const* p) { return ncclReduceScatter(p[0], p[1], a.count, a.type, a.op, comm_, stream_); });
      case collective::all_to_all:
        return run_checked(desc, until, {in, out}, [&](void* const* p) {
          const std::size_t block_bytes = a.count * size_of(c.type);
          const auto* source = static_cast<const std::byte*>(p[0]);
          auto* target = static_cast<std::byte*>(p[1]);
          ncclResult_t result = ncclGroupStart();
          for (int peer = 0; peer < size_ && result == ncclSuccess; ++peer) {
            const auto offset = block_bytes * static_cast<std::size_t>(peer);
            result = ncclSend(source + offset, a.count, a.type, peer, comm_, stream_);
            if (result == ncclSuccess) result = ncclRecv(target + offset, a.count, a.type, peer, comm_, stream_);
          }
          const ncclResult_t end = ncclGroupEnd();
          return result != ncclSuccess ? result : end;
        });
      case collective::barrier:
        return run_checked(desc, until, {}, [&](void* const*) { return ncclAllReduce(fingerprint_, fingerprint_, 1, ncclUint64, ncclMax, comm_, stream_); });
      case collective::send:
        return run_unchecked(desc, until, {in}, [&](void* const* p) { return ncclSend(p[0], a.count, a.type, a.root, comm_, stream_); });
      case collective::recv:
        return run_unchecked(desc, until, {out}, [&](void* const* p) { return ncclRecv(p[0], a.count, a.type, a.root, comm_, stream_); });
    }
    throw error(errc::unavailable, std::string(to_string(c.op)) + " is not offered by the NCCL backend", desc.context(rank_));
  }

  /// Aborts the communicator: every waiter returns with errc::peer_lost; the backend is unusable afterwards.
  void abort() noexcept { aborted_.store(true); }

 private:
  // One buffer a collective reads (in), writes (out), or both; host memory is staged.
  struct operand {
    const void* read = nullptr;  // copied to the device before the operation when staged
    void* write = nullptr;       // copied back to the host after it when staged
    std::size_t bytes = 0;
    const void* address() const noexcept { return read != nullptr ? read : write; }
  };
  static constexpr std::size_t max_operands = 2;
  using operands = std::array<operand, max_operands>;
  // Puts the operation on the backend's stream, given the device addresses of the operands.
  using enqueue_ref = detail::function_ref<ncclResult_t(void* const*)>;


  template <class T>
  collective_desc next(collective op, std::size_t n, reduce_kind reduction = reduce_kind::sum, int root = -1) {
    return collective_desc{.seq = seq_++, .op = op, .type = dtype_of<T>, .reduction = reduction, .root = root, .count = n};
  }
  static deadline default_deadline() { return deadline::after(default_timeout()); }

  // Where a call failed; formatted only then (a successful call builds no strings).
  struct call_site {
    const collective_desc* desc = nullptr;  // a collective's, formatted on failure
    const error_context* known = nullptr;   // or one made already (set-up)
    int rank = -1;
    error_context context() const { return desc != nullptr ? desc->context(rank) : *known; }
  };
  static void check(cudaError_t code, const char* call, const call_site& site) {
    if (code != cudaSuccess) detail::cuda_check(code, call, site.context());
  }
  void check(ncclResult_t code, const char* call, const call_site& site) const {
    if (code != ncclSuccess && code != ncclInProgress) detail::nccl_check(code, call, comm_, site.context());
  }

  // Agrees on the fingerprint (MAX over {h, ~h} is {h, ~h} everywhere only if all are equal),
  // then runs the operation.
  void run_checked(const collective_desc& desc, deadline until, operands ops, enqueue_ref enqueue) {
    const call_site site{.desc = &desc, .rank = rank_};
    if (options_.check_collectives && size_ > 1) {
      const std::uint64_t h = wire_header::encode(desc.normalized()).fingerprint();
      std::uint64_t agreed[2] = {h, ~h};
      run_unchecked(desc, until, {operand{agreed, agreed, sizeof agreed}}, [&](void* const* p) {
        return ncclAllReduce(p[0], p[0], 2, ncclUint64, ncclMax, comm_, stream_);
      });
      if (agreed[0] != h || agreed[1] != ~h) {
        throw error(errc::mismatch, "ranks called different collectives at this sequence number (NCCL reports no details: run with "
                                    "the ring backend to see both calls)", site.context());
      }
    }
    run_unchecked(desc, until, ops, enqueue);
  }

  // Stages host operands, orders the stream after the compute stream, enqueues, waits for the
  // stream (with the deadline), and copies staged results back.
  void run_unchecked(const collective_desc& desc, deadline until, operands ops, enqueue_ref enqueue) {
    const call_site site{.desc = &desc, .rank = rank_};
    if (aborted_.load() || comm_ == nullptr) throw error(errc::peer_lost, "the NCCL communicator was aborted by an earlier error", site.context());
    // Nothing to move (every rank has count 0: the fingerprints agreed on it): NCCL is not called.
    if (desc.op != collective::barrier && std::all_of(ops.begin(), ops.end(), [](const operand& o) { return o.bytes == 0; })) return;
    int current = -1;  // the calling thread may be the group's, on another device
    if (cudaGetDevice(&current) != cudaSuccess || current != device_) check(cudaSetDevice(device_), "cudaSetDevice", site);

    std::array<void*, max_operands> device{};
    std::array<bool, max_operands> staged{};
    std::size_t staging_bytes = 0;
    for (std::size_t i = 0; i < max_operands; ++i) {
      if (ops[i].bytes == 0 || detail::device_addressable(ops[i].address())) continue;
      staged[i] = true;
      staging_bytes += round_up(ops[i].bytes);
    }
    if (staging_bytes > staging_.size()) staging_ = device_buffer<std::uint8_t>(staging_bytes);
    std::size_t offset = 0;
    for (std::size_t i = 0; i < max_operands; ++i) {
      device[i] = const_cast<void*>(ops[i].address());
      if (!staged[i]) continue;
      device[i] = staging_.data() + offset;
      offset += round_up(ops[i].bytes);
      if (ops[i].read != nullptr)
        check(cudaMemcpyAsync(device[i], ops[i].read, ops[i].bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync", site);
    }
    if (options_.compute_stream != stream_) {
      check(cudaEventRecord(inputs_ready_, options_.compute_stream), "cudaEventRecord", site);
      check(cudaStreamWaitEvent(stream_, inputs_ready_, 0), "cudaStreamWaitEvent", site);
    }
    check(enqueue(device.data()), to_string(desc.op).data(), site);
    wait_comm_ready(site, until);
    wait_stream(site, until);
    // Only now: a copy into pageable memory blocks the host until the stream's earlier work is
    // done, which for an operation waiting on a dead peer is never (no deadline there).
    bool copied_back = false;
    for (std::size_t i = 0; i < max_operands; ++i) {
      if (!staged[i] || ops[i].write == nullptr) continue;
      check(cudaMemcpyAsync(ops[i].write, device[i], ops[i].bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync", site);
      copied_back = true;
    }
    if (copied_back) wait_stream(site, until);
  }

  static std::size_t round_up(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

  // Non-blocking communicators return ncclInProgress while an enqueue completes.
  void wait_comm_ready(const call_site& site, deadline until) {
    ncclResult_t state = ncclInProgress;
    while (true) {
      check(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError", site);
      if (state == ncclSuccess) return;
      check(state, "NCCL (asynchronous error)", site);  // throws unless still in progress
      check_abort_or_deadline(site, until);
    }
  }

  // Completion is an event recorded after the work: polled, so that NCCL's asynchronous errors,
  // abort() and the deadline are seen while waiting.
  void wait_stream(const call_site& site, deadline until) {
    check(cudaEventRecord(completed_, stream_), "cudaEventRecord", site);
    while (true) {
      const cudaError_t done = cudaEventQuery(completed_);
      if (done == cudaSuccess) return;
      if (done != cudaErrorNotReady) check(done, "cudaEventQuery", site);
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      check(state, "NCCL (asynchronous error)", site);
      check_abort_or_deadline(site, until);
    }
  }

  void check_abort_or_deadline(const call_site& site, deadline until) {
    if (aborted_.load(std::memory_order_relaxed)) {
      abort_communicator();
      throw error(errc::peer_lost, "the NCCL communicator was aborted while waiting", site.context());
    }
    if (until.expired()) {
      aborted_.store(true);
      abort_communicator();
      throw error(errc::timeout, "not completed before the deadline: a peer is missing, dead or stuck; the communicator was aborted",
                  site.context());
    }
  }

  // Called by the waiting thread only (ncclCommAbort must not race with other calls on the communicator).
  void abort_communicator() noexcept {
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
  }


  int rank_ = 0;
  int size_ = 1;
  int device_ = 0;
  nccl_options options_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t inputs_ready_ = nullptr;  // recorded on the compute stream, waited for by stream_
  cudaEvent_t completed_ = nullptr;     // recorded on stream_ after an operation, polled by the waiter
  ncclComm_t comm_ = nullptr;
  std::uint64_t* fingerprint_ = nullptr;
  device_buffer<std::uint8_t> staging_;  // host operands pass through here (grown on demand)
  std::uint64_t seq_ = 0;
  std::atomic<bool> aborted_{false};
};

static_assert(backend<nccl_backend>);

}  // namespace ddp
