// ddp_bench_nccl_calls: what each CUDA / NCCL call on nccl_backend's path costs on this machine,
// one rank on device 0, so the wrapper's overhead in ddp_bench_nccl can be read off call by call.
//
//   ddp_bench_nccl_calls [--iters N] [--rounds R]
//
// Each line is the median over R rounds (default 5) of the mean over N calls (default 5000) of one
// call or short sequence, in microseconds. The last rows are whole all-reduces of one float:
// ncclAllReduce on a blocking and on a non-blocking communicator, then nccl_backend alone and
// through process_group (what ddp_bench_nccl's "ddp" side calls). Exit status: 0, 2 bad flags,
// 77 no CUDA device visible (SKIPPED).
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "../common/bench_table.hpp"
#include "ddp/backends/nccl.hpp"
#include "ddp/process_group.hpp"
#include "ddp/store/hash_store.hpp"

namespace {

using ddp::detail::cuda_check;
using ddp::detail::nccl_check;

struct settings {
  int iters = 5000;
  int rounds = 5;
};

// Median over rounds of the mean microseconds per call.
template <class Call>
double microseconds_per_call(const settings& s, Call&& call) {
  for (int i = 0; i < std::min(s.iters, 100); ++i) call();  // warm-up
  std::vector<double> means;
  for (int round = 0; round < s.rounds; ++round) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < s.iters; ++i) call();
    means.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / s.iters);
  }
  std::sort(means.begin(), means.end());
  return means[means.size() / 2];
}

void row(const char* what, double us) {
  std::printf("%-78s %8.3f\n", what, us);
  std::fflush(stdout);
}

ncclComm_t world_of_one(bool blocking) {
  ncclUniqueId id{};
  nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = blocking ? 1 : 0;
  ncclComm_t comm = nullptr;
  nccl_check(ncclCommInitRankConfig(&comm, 1, id, 0, &config), "ncclCommInitRankConfig", comm);
  ncclResult_t state = ncclInProgress;
  while (state == ncclInProgress) nccl_check(ncclCommGetAsyncError(comm, &state), "ncclCommGetAsyncError", comm);
  nccl_check(state, "ncclCommInitRankConfig", comm);
  return comm;
}

void spin_until_done(cudaEvent_t event, cudaStream_t stream) {
  cuda_check(cudaEventRecord(event, stream), "cudaEventRecord");
  cudaError_t done = cudaErrorNotReady;
  while ((done = cudaEventQuery(event)) == cudaErrorNotReady) {
  }
  cuda_check(done, "cudaEventQuery");
}

int parse_positive(const char* flag, const char* text) {
  const auto value = ddp::bench::parse_int(text, 1, 10000000);
  if (!value) {
    std::fprintf(stderr, "ddp_bench_nccl_calls: %s %s: expected a positive integer\n", flag, text);
    std::exit(2);
  }
  return *value;
}

}  // namespace

int main(int argc, char** argv) {
  settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if ((flag == "--iters" || flag == "--rounds") && i + 1 < argc) {
      (flag == "--iters" ? s.iters : s.rounds) = parse_positive(argv[i], argv[i + 1]);
      ++i;
    } else {
      std::fprintf(stderr, "usage: ddp_bench_nccl_calls [--iters N] [--rounds R]\n");
      return 2;
    }
  }
  int devices = 0;
  if (const cudaError_t code = cudaGetDeviceCount(&devices); code != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "SKIPPED: no CUDA device visible (%s)\n", code != cudaSuccess ? cudaGetErrorString(code) : "0 devices");
    return 77;
  }
  try {
    cuda_check(cudaSetDevice(0), "cudaSetDevice");
    cudaStream_t stream = nullptr;
    cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    cudaEvent_t event = nullptr;
    cudaEvent_t done = nullptr;
    cuda_check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    ddp::device_buffer<float> device(1);
    cuda_check(cudaMemset(device.data(), 0, sizeof(float)), "cudaMemset");
    std::vector<float> host(1, 0.0f);
    ncclComm_t blocking = world_of_one(true);
    ncclComm_t non_blocking = world_of_one(false);

    std::printf("# microseconds per call, one rank on device 0: median over %d rounds of the mean over %d calls\n", s.rounds, s.iters);
    std::printf("%-78s %8s\n", "call", "us");
    int current = 0;
    row("cudaGetDevice", microseconds_per_call(s, [&] { (void)cudaGetDevice(&current); }));
    row("cudaSetDevice (already current)", microseconds_per_call(s, [&] { (void)cudaSetDevice(0); }));
    row("cudaPointerGetAttributes, device memory", microseconds_per_call(s, [&] { (void)ddp::detail::device_addressable(device.data()); }));
    row("cudaPointerGetAttributes, pageable host memory", microseconds_per_call(s, [&] { (void)ddp::detail::device_addressable(host.data()); }));
    row("ncclCommGetAsyncError", microseconds_per_call(s, [&] {
          ncclResult_t state = ncclSuccess;
          (void)ncclCommGetAsyncError(non_blocking, &state);
        }));
    row("cudaEventRecord on the legacy stream + cudaStreamWaitEvent", microseconds_per_call(s, [&] {
          (void)cudaEventRecord(event, cudaStreamLegacy);
          (void)cudaStreamWaitEvent(stream, event, 0);
        }));
    row("cudaEventRecord + cudaEventQuery until done (idle stream)", microseconds_per_call(s, [&] { spin_until_done(done, stream); }));
    row("cudaStreamSynchronize (idle stream)", microseconds_per_call(s, [&] { (void)cudaStreamSynchronize(stream); }));
    row("ncclAllReduce 4 B, blocking communicator + cudaStreamSynchronize", microseconds_per_call(s, [&] {
          nccl_check(ncclAllReduce(device.data(), device.data(), 1, ncclFloat32, ncclSum, blocking, stream), "ncclAllReduce");
          cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        }));
    row("ncclAllReduce 4 B, non-blocking communicator + async error + event wait", microseconds_per_call(s, [&] {
          nccl_check(ncclAllReduce(device.data(), device.data(), 1, ncclFloat32, ncclSum, non_blocking, stream), "ncclAllReduce");
          ncclResult_t state = ncclInProgress;
          while (state == ncclInProgress) nccl_check(ncclCommGetAsyncError(non_blocking, &state), "ncclCommGetAsyncError");
          spin_until_done(done, stream);
        }));
    row("  the same, ordered after the legacy stream (event + wait first)", microseconds_per_call(s, [&] {
          (void)cudaEventRecord(event, cudaStreamLegacy);
          (void)cudaStreamWaitEvent(stream, event, 0);
          nccl_check(ncclAllReduce(device.data(), device.data(), 1, ncclFloat32, ncclSum, non_blocking, stream), "ncclAllReduce");
          ncclResult_t state = ncclInProgress;
          while (state == ncclInProgress) nccl_check(ncclCommGetAsyncError(non_blocking, &state), "ncclCommGetAsyncError");
          spin_until_done(done, stream);
        }));
    ncclCommDestroy(blocking);
    ncclCommDestroy(non_blocking);

    ddp::store::hash_store store;
    ddp::nccl_backend backend(store, 0, 1);
    const std::span<float> one(device.data(), 1);
    row("nccl_backend::all_reduce 4 B", microseconds_per_call(s, [&] { backend.all_reduce(one, ddp::sum{}); }));
    ddp::process_group<ddp::nccl_backend> group(std::move(backend));
    row("process_group<nccl_backend>::all_reduce 4 B", microseconds_per_call(s, [&] { group.all_reduce(one, ddp::sum{}); }));
    row("process_group<nccl_backend>::all_reduce 4 B, pageable host memory (staged)",
        microseconds_per_call(s, [&] { group.all_reduce(std::span<float>(host), ddp::sum{}); }));

    cudaEventDestroy(event);
    cudaEventDestroy(done);
    cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_bench_nccl_calls: %s\n", e.what());
    return 1;
  }
  return 0;
}
