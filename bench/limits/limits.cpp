// What this machine can do, as baselines for the all-reduce benchmarks:
//   ddp_bench_limits --probe [--copy] [--bind cpus|none] [sweep flags]
//                                                      the bare two-process shared-memory all-reduce
//                                                      (the "limit" line), same columns as ddp_bench_allreduce;
//                                                      ranks bound as ddp_bench_allreduce binds them
//   ddp_bench_limits --bandwidth                       memcpy with 1 and 2 threads, loopback TCP stream
//                                                      one way and both ways at once
//   ddp_bench_limits --copy-distance                   memcpy and ddp's bulk_copy of an in-cache block at
//                                                      several distances of the destination past the
//                                                      source modulo a page (bench/README, "The slow copy
//                                                      distance")
//   ddp_bench_limits --receive-offset                  the loopback TCP stream received at several
//                                                      offsets of the buffer in its page
//
// The probe: both ranks' buffers live in one shared mapping; each rank adds its half of the
// peer's buffer into its own and writes the sum into both (in place, no copies), then a spin
// barrier. With --copy each rank first copies its private input in and the result out, as a
// library must for ordinary user buffers.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "../common/bench_table.hpp"
#include "../common/rank_binding.hpp"
#include "ddp/backends/ring/transport/socket.hpp"
#include "ddp/core/bulk_copy.hpp"

namespace {

using seconds = std::chrono::duration<double>;

struct alignas(64) probe_control {
  std::atomic<std::uint64_t> arrived[2];
};

void spin_barrier(probe_control* c, int rank, std::uint64_t generation) {
  c->arrived[rank].store(generation, std::memory_order_release);
  unsigned spins = 0;
  while (c->arrived[1 - rank].load(std::memory_order_acquire) < generation) {
    if (++spins > 4096) sched_yield();  // two cores: let the peer run
  }
}

int probe(const ddp::bench::sweep_options& options, bool copy, bool bind) {
  const auto sizes = ddp::bench::sizes(options);
  const std::size_t max_floats = sizes.back() / 4;
  const std::size_t bytes = sizeof(probe_control) + 2 * max_floats * sizeof(float);
  void* shared = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) return 1;
  auto* control = new (shared) probe_control{};
  auto* buffers = reinterpret_cast<float*>(static_cast<char*>(shared) + sizeof(probe_control));
  std::memset(buffers, 0, 2 * max_floats * sizeof(float));  // pre-touch
  ddp::bench::sweep_options o = options;
  o.system = copy ? "probe-copy" : "probe";
  ddp::bench::print_header(o, 2, copy ? "bare shared-memory probe with copy in/out" : "bare shared-memory probe (in place)");
  const ddp::bench::rank_binding binding(bind, 2, "ddp_bench_limits");
  const pid_t child = ::fork();
  const int rank = child == 0 ? 1 : 0;
  binding.apply(rank, "ddp_bench_limits");
  std::vector<float> user(max_floats, 1.0f);
  std::uint64_t generation = 0;
  for (std::size_t size_bytes : sizes) {
    const std::size_t n = size_bytes / 4;
    float* mine = buffers + static_cast<std::size_t>(rank) * max_floats;
    float* peer = buffers + static_cast<std::size_t>(1 - rank) * max_floats;
    const std::size_t half = n / 2, begin = rank == 0 ? 0 : half, end = rank == 0 ? half : n;
    auto once = [&] {
      if (copy) std::memcpy(mine, user.data(), n * sizeof(float));
      spin_barrier(control, rank, ++generation);
      for (std::size_t i = begin; i < end; ++i) {
        const float s = mine[i] + peer[i];
        mine[i] = s;
        peer[i] = s;
      }
      spin_barrier(control, rank, ++generation);
      if (copy) std::memcpy(user.data(), mine, n * sizeof(float));
    };
    for (int i = 0, n = ddp::bench::warmup_for(size_bytes, options); i < n; ++i) once();
    const int iters = ddp::bench::iterations_for(size_bytes, options.iters);
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) once();
    const double t = seconds(std::chrono::steady_clock::now() - start).count() / iters;
    if (rank == 0) ddp::bench::print_row(o, 2, size_bytes, t);
  }
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  ::munmap(shared, bytes);
  return 0;
}

double memcpy_gbs(int threads, std::size_t bytes) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  auto copy_part = [&](int t, int reps) {
    const std::size_t part = bytes / static_cast<std::size_t>(threads);
    for (int r = 0; r < reps; ++r) std::memcpy(dst.data() + part * static_cast<std::size_t>(t), src.data() + part * static_cast<std::size_t>(t), part);
  };
  const int reps = 10;
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(copy_part, t, reps);
  for (auto& th : pool) th.join();
  return static_cast<double>(bytes) * reps / seconds(std::chrono::steady_clock::now() - start).count() / 1e9;
}

// A loopback connection between this process and a forked child: the child runs child(fd) on its
// end (true: it went right), this process parent(fd) on the other. parent's result, or 0 when
// either side failed.
template <class Child, class Parent>
double over_loopback(Child child, Parent parent) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  ::listen(listener, 1);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int s = ::socket(AF_INET, SOCK_STREAM, 0);
    if (::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) ::_exit(1);
    const bool ok = child(s);
    ::close(s);
    ::_exit(ok ? 0 : 1);
  }
  const int c = ::accept(listener, nullptr, nullptr);
  const double result = parent(c);
  ::close(c);
  ::close(listener);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 && result > 0 ? result : 0.0;
}

// The first page boundary inside `memory`.
char* first_page_of(std::vector<char>& memory) {
  constexpr std::uintptr_t page = 4096;
  return memory.data() + (page - reinterpret_cast<std::uintptr_t>(memory.data()) % page) % page;
}

// One way: the child sends `total` bytes from a page-aligned buffer, this process receives them
// into a buffer `receive_offset` bytes into its page. The kernel's copy into user memory is slower
// at some offsets (bench/README, "TCP against the loopback's limits"); --bandwidth receives
// page-aligned, the best case, as a limit should.
double tcp_stream_gbs(std::size_t total, std::size_t receive_offset) {
  constexpr std::size_t page = 4096, chunk = std::size_t{1} << 20;
  std::vector<char> memory(chunk + 2 * page, 7);
  char* const aligned = first_page_of(memory);
  return over_loopback(
      [&](int fd) {
        for (std::size_t sent = 0; sent < total;) {
          const ssize_t n = ::send(fd, aligned, std::min(chunk, total - sent), 0);
          if (n <= 0) return false;
          sent += static_cast<std::size_t>(n);
        }
        return true;
      },
      [&](int fd) {
        char* const in = aligned + receive_offset;
        const auto start = std::chrono::steady_clock::now();
        std::size_t got = 0;
        while (got < total) {
          const ssize_t n = ::recv(fd, in, std::min(chunk, total - got), 0);
          if (n <= 0) break;
          got += static_cast<std::size_t>(n);
        }
        return static_cast<double>(got) / seconds(std::chrono::steady_clock::now() - start).count() / 1e9;
      });
}

// The one-way stream at several receive offsets, interleaved: median, lowest and highest of 9.
int receive_offsets(bool csv) {
  const std::size_t offsets[] = {0, 8, 16, 32, 64, 2048};
  constexpr int rounds = 9;
  std::vector<std::vector<double>> rates(std::size(offsets));
  for (int round = 0; round < rounds; ++round) {
    for (std::size_t i = 0; i < std::size(offsets); ++i) rates[i].push_back(tcp_stream_gbs(std::size_t{256} << 20, offsets[i]));
    std::fprintf(stderr, "\rround %d of %d", round + 1, rounds);
  }
  std::fprintf(stderr, "\n");
  if (csv) std::printf("receive_offset,median_gbs,min_gbs,max_gbs\n");
  else std::printf("| receive offset in its page | median GB/s | lowest | highest |\n| ---: | ---: | ---: | ---: |\n");
  for (std::size_t i = 0; i < std::size(offsets); ++i) {
    auto& r = rates[i];
    std::sort(r.begin(), r.end());
    if (csv) std::printf("%zu,%.3f,%.3f,%.3f\n", offsets[i], r[r.size() / 2], r.front(), r.back());
    else std::printf("| %zu | %.2f | %.2f | %.2f |\n", offsets[i], r[r.size() / 2], r.front(), r.back());
  }
  return 0;
}

// Both directions at once over one loopback connection, as a 2-rank ring all-reduce runs: each
// process sends `total` bytes and receives `total` bytes from one thread with non-blocking
// sockets and poll (the ring transport's own way). Returns the bytes per second of one direction:
// the busbw a p = 2 TCP all-reduce could reach if it did nothing but move bytes.
double tcp_duplex_gbs(std::size_t total) {
  // Both sides start their transfer only once both are connected and ready (one byte each way).
  auto exchange = [total](int fd) {
    ddp::detail::tcp::tune_data_socket(fd, 4 << 20);  // as the transport does, at tcp_options' default size
    char ready = 1;
    if (::send(fd, &ready, 1, 0) != 1 || ::recv(fd, &ready, 1, MSG_WAITALL) != 1) return -1.0;
    ddp::detail::tcp::set_nonblocking(fd);
    // Page-aligned receives, the kernel's fastest case (tcp_stream_gbs).
    constexpr std::size_t page = 4096, chunk = std::size_t{1} << 20;
    std::vector<char> out(chunk, 7), memory(chunk + page);
    char* const in = first_page_of(memory);
    const auto start = std::chrono::steady_clock::now();
    std::size_t sent = 0, got = 0;
    while (sent < total || got < total) {
      pollfd p{fd, static_cast<short>((sent < total ? POLLOUT : 0) | (got < total ? POLLIN : 0)), 0};
      if (::poll(&p, 1, 10'000) <= 0) return -1.0;
      if ((p.revents & POLLOUT) != 0) {
        const ssize_t n = ::send(fd, out.data(), std::min(out.size(), total - sent), MSG_NOSIGNAL);
        if (n > 0) sent += static_cast<std::size_t>(n);
        else if (n < 0 && errno != EAGAIN) return -1.0;
      }
      if ((p.revents & (POLLIN | POLLHUP)) != 0) {
        const ssize_t n = ::recv(fd, in, std::min(chunk, total - got), 0);
        if (n > 0) got += static_cast<std::size_t>(n);
        else if (n == 0 || errno != EAGAIN) return -1.0;
      }
    }
    return seconds(std::chrono::steady_clock::now() - start).count();
  };
  return over_loopback([&](int fd) { return exchange(fd) > 0; },
                       [&](int fd) {
                         const double t = exchange(fd);
                         return t > 0 ? static_cast<double>(total) / t / 1e9 : 0.0;
                       });
}

// Microseconds per copy of `bytes` from a page-aligned source to a destination `distance` bytes
// past it modulo a page, the block warm in cache: the median of 7 timings of `reps` copies.
template <class Copy>
double copy_us(Copy copy, std::size_t bytes, std::size_t distance) {
  constexpr std::size_t page = 4096;
  std::vector<char> memory(2 * bytes + 4 * page, 1);
  char* const src = first_page_of(memory);
  char* const dst = src + (bytes + page - 1) / page * page + page + distance;
  const int reps = static_cast<int>(std::max<std::size_t>(20, (std::size_t{64} << 20) / std::max<std::size_t>(bytes, 1) / 8));
  std::vector<double> times;
  for (int round = 0; round < 7; ++round) {
    for (int w = 0; w < 5; ++w) copy(dst, src, bytes);
    const auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) {
      copy(dst, src, bytes);
      asm volatile("" : : "r"(dst) : "memory");  // every copy happens
    }
    times.push_back(seconds(std::chrono::steady_clock::now() - start).count() * 1e6 / reps);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

int copy_distance(bool csv) {
  const std::size_t sizes[] = {4096, 16384, 65536, 262144, 1048576, 4194304};
  const std::size_t distances[] = {0, 1, 8, 16, 31, 32, 48, 4080};
  auto libc = [](void* d, const void* s, std::size_t n) { std::memcpy(d, s, n); };
  auto ours = [](void* d, const void* s, std::size_t n) { ddp::detail::bulk_copy(d, s, n); };
  if (csv) std::printf("bytes,distance,memcpy_us,bulk_copy_us\n");
  else std::printf("| bytes | distance | memcpy, us | bulk_copy, us | memcpy / bulk_copy |\n| ---: | ---: | ---: | ---: | ---: |\n");
  for (const std::size_t bytes : sizes) {
    for (const std::size_t distance : distances) {
      const double m = copy_us(libc, bytes, distance), b = copy_us(ours, bytes, distance);
      if (csv) std::printf("%zu,%zu,%.3f,%.3f\n", bytes, distance, m, b);
      else std::printf("| %zu | %zu | %.2f | %.2f | %.2f |\n", bytes, distance, m, b, m / b);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::bench::sweep_options options;
  std::vector<std::string> rest;
  if (!ddp::bench::parse_common(argc, argv, options, rest)) return 2;
  bool do_probe = false, copy = false, bandwidth = false, distance = false, offsets = false, bind = true;
  for (std::size_t i = 0; i < rest.size(); ++i) {
    const auto& a = rest[i];
    if (a == "--probe") do_probe = true;
    else if (a == "--copy") copy = true;
    else if (a == "--bandwidth") bandwidth = true;
    else if (a == "--copy-distance") distance = true;
    else if (a == "--receive-offset") offsets = true;
    else if (a == "--bind" && i + 1 < rest.size() && (rest[i + 1] == "cpus" || rest[i + 1] == "none")) bind = rest[++i] == "cpus";
    else {
      std::fprintf(stderr, "unknown flag %s\nusage: ddp_bench_limits --probe [--copy] [--bind cpus|none] [--csv] | --bandwidth [--csv] | --copy-distance [--csv] | --receive-offset [--csv]\n", a.c_str());
      return 2;
    }
  }
  if (do_probe) return probe(options, copy, bind);
  if (distance) return copy_distance(options.csv);
  if (offsets) return receive_offsets(options.csv);
  if (bandwidth) {
    const std::size_t bytes = std::size_t{64} << 20;
    const double one = memcpy_gbs(1, bytes), two = memcpy_gbs(2, bytes), tcp = tcp_stream_gbs(std::size_t{1} << 30, 0);
    const double duplex = tcp_duplex_gbs(std::size_t{1} << 30);
    if (options.csv) {
      std::printf("limit,value_gbs\nmemcpy_1thread,%.3f\nmemcpy_2threads,%.3f\ntcp_loopback_stream,%.3f\ntcp_loopback_duplex,%.3f\n", one, two,
                  tcp, duplex);
    } else {
      std::printf("memcpy, 1 thread (64 MiB):   %7.2f GB/s\n", one);
      std::printf("memcpy, 2 threads (64 MiB):  %7.2f GB/s\n", two);
      std::printf("TCP loopback stream (1 GiB): %7.2f GB/s\n", tcp);
      std::printf("TCP loopback, both ways at once (1 GiB each way): %7.2f GB/s each way\n", duplex);
      // A 2-rank ring all-reduce moves each byte across the link once each way, both ways at the
      // same time: busbw <= the rate of one direction while the other runs too.
      std::printf("best achievable busbw, TCP, p=2: about %.2f GB/s (both ways at once)\n", duplex);
    }
    return 0;
  }
  std::fprintf(stderr, "usage: ddp_bench_limits --probe [--copy] [--bind cpus|none] [--csv] | --bandwidth [--csv] | --copy-distance [--csv] | --receive-offset [--csv]\n");
  return 2;
}
