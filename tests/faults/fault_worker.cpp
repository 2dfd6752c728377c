// The rank program of the kill campaign (kill_campaign.py): one 4-rank job, started by ddprun or
// by hand, through the phases a job goes through, each announced on stdout so that the campaign
// can SIGKILL a process at a moment of its choosing:
//   fault_worker rank=R pid=P phase=rendezvous   before init_process_group
//   fault_worker rank=R pid=P phase=allocate     before the group allocates its shared buffers
//   fault_worker rank=R pid=P phase=step         before the first of --steps all_reduces
//   fault_worker rank=R pid=P phase=shutdown     before the last barrier and the group's end
//   fault_worker rank=R pid=P phase=done         after the group has ended
// Every all_reduce's result is checked against its closed form. A failure is one line on stderr,
//   fault_worker rank=R pid=P t=T error: <what()>   (exit 1)
//   fault_worker rank=R pid=P t=T wrong result: ...  (exit 3)
// A SIGTERM (a launcher ending the survivors of a job) is announced before it takes its usual
// effect, with its sender, so that the campaign knows which ranks a launcher ended and when:
//   fault_worker rank=R pid=P t=T terminated: SIGTERM from pid S
// T is CLOCK_MONOTONIC in nanoseconds when the line was made: a launcher that relays the ranks'
// output (mpirun) may reorder lines of different ranks, so the campaign orders them by T.
// Options: --transport shm|tcp|hier (shm: backend "ring", which uses shared memory when every
// rank is on this host; tcp: backend "tcp", TCP between local ranks too; hier: the ring backend's
// hierarchy, with ranks 2h and 2h+1 posing as host h (ring_options::host_identity): shared memory
// within a host, TCP between the hosts' leaders, registered as backend "hier"), --steps N, --count N (floats
// per all_reduce), --prefix P (store key prefix; it is part of the shared-memory segment names,
// which lets the campaign tell this job's segments from others').
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/ddp.hpp>

namespace {

int rank_for_lines = -1;  // -1 until known: the launcher's rank from the environment

// "fault_worker rank=R pid=P", the start of every line.
std::string line_prefix() { return "fault_worker rank=" + std::to_string(rank_for_lines) + " pid=" + std::to_string(::getpid()); }

void line(std::FILE* f, const std::string& text) {
  // One write per line: the ranks share the launcher's pipes, and lines must not interleave.
  const std::string out = line_prefix() + " " + text + "\n";
  std::fputs(out.c_str(), f);
  std::fflush(f);
}

void phase(const char* name) { line(stdout, std::string("phase=") + name); }

// CLOCK_MONOTONIC in nanoseconds, the campaign's clock too (Python's time.monotonic);
// async-signal-safe.
long long monotonic_ns() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// A line that the campaign orders by time: "t=T <text>".
void timed_line(const std::string& text) { line(stderr, "t=" + std::to_string(monotonic_ns()) + " " + text); }

// The SIGTERM line's text up to the sender's pid, made outside the handler (which may only call
// async-signal-safe functions) whenever the rank becomes known.
char terminated_prefix[96];
std::size_t terminated_prefix_length = 0;

void prepare_terminated_line() {
  const std::string text = line_prefix() + " t=";
  terminated_prefix_length = std::min(text.size(), sizeof terminated_prefix);
  text.copy(terminated_prefix, terminated_prefix_length);
}

// Appends the decimal digits of v >= 0 at out + n; returns the new length. Async-signal-safe.
std::size_t append_decimal(char* out, std::size_t n, long long v) noexcept {
  char digits[24];
  std::size_t d = 0;
  do {
    digits[d++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v > 0);
  while (d > 0) out[n++] = digits[--d];
  return n;
}

extern "C" void on_sigterm(int, siginfo_t* info, void*) {
  static constexpr char middle[] = " terminated: SIGTERM from pid ";
  char out[sizeof terminated_prefix + sizeof middle + 48];
  std::size_t n = 0;
  for (std::size_t i = 0; i < terminated_prefix_length; ++i) out[n++] = terminated_prefix[i];
  n = append_decimal(out, n, monotonic_ns());
  for (std::size_t i = 0; i + 1 < sizeof middle; ++i) out[n++] = middle[i];
  n = append_decimal(out, n, info->si_pid);
  out[n++] = '\n';
  [[maybe_unused]] const auto written = ::write(STDERR_FILENO, out, n);
  ::signal(SIGTERM, SIG_DFL);  // then the usual end: death by SIGTERM
  ::raise(SIGTERM);
}

// The rank that lines name from now on (the SIGTERM line's text follows it).
void set_rank_for_lines(int rank) {
  rank_for_lines = rank;
  prepare_terminated_line();
}

void announce_sigterm() {
  prepare_terminated_line();
  struct sigaction sa {};
  sa.sa_sigaction = on_sigterm;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
}

struct wrong_result {
  std::string what;
};

// Rank r contributes (r + 1) * (i % 7 + step % 5 + 1) at element i; the sum over p ranks is
// p (p + 1) / 2 times that factor, exact in float for these magnitudes.
void fill(std::span<float> data, int rank, int step) {
  for (std::size_t i = 0; i < data.size(); ++i)
    data[i] = static_cast<float>(rank + 1) * static_cast<float>(i % 7 + static_cast<std::size_t>(step % 5) + 1);
}
void check(std::span<const float> data, int world, int step, const char* what) {
  const float ranks = static_cast<float>(world * (world + 1) / 2);
  for (std::size_t i = 0; i < data.size(); ++i) {
    const float want = ranks * static_cast<float>(i % 7 + static_cast<std::size_t>(step % 5) + 1);
    if (data[i] != want) {
      throw wrong_result{std::string(what) + " all_reduce at step " + std::to_string(step) + ": element " + std::to_string(i) +
                         " is " + std::to_string(data[i]) + ", expected " + std::to_string(want)};
    }
  }
}

// Backend "hier": the ring backend as init_process_group builds it, except that ranks 2h and
// 2h+1 pose as host h and the hierarchy is forced, so that one machine runs the two-level path
// (each host's shared memory, the leaders' TCP ring) and its failures.
ddp::group make_hierarchical(const ddp::backend_context& c) {
  ddp::ring_options o;
  o.prefix = c.prefix;
  o.timeout = c.options.init_timeout;
  o.hierarchy = ddp::ring_options::hierarchy_kind::hierarchical;
  o.host_identity = "fault-host-" + std::to_string(c.rank / 2);
  return ddp::group(ddp::process_group<ddp::ring_backend>(ddp::ring_backend(c.store, c.rank, c.world_size, o), {.timeout = c.options.timeout}));
}

}  // namespace

int main(int argc, char** argv) {
  std::string transport = "shm", prefix = "ddp";
  int steps = 200;
  std::size_t count = std::size_t{1} << 16;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "fault_worker: %s needs a value\n", argv[i]);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--transport") transport = value();
    else if (a == "--steps") steps = std::atoi(value().c_str());
    else if (a == "--count") count = static_cast<std::size_t>(std::atoll(value().c_str()));
    else if (a == "--prefix") prefix = value();
    else {
      std::fprintf(stderr, "fault_worker: unknown argument '%s'\n", argv[i]);
      return 2;
    }
  }
  if (transport != "shm" && transport != "tcp" && transport != "hier") {
    std::fprintf(stderr, "fault_worker: --transport %s: expected shm, tcp or hier\n", transport.c_str());
    return 2;
  }
  if (transport == "hier") ddp::register_backend("hier", make_hierarchical);
  // The rank as the launcher gives it (RANK, OMPI_COMM_WORLD_RANK, ...), so that a line printed
  // before init_process_group returns still says whose it is; a bad environment is init's error.
  try {
    rank_for_lines = ddp::launch_environment::from_environment().rank;
  } catch (const std::exception&) {
  }
  announce_sigterm();
  try {
    phase("rendezvous");
    ddp::init_options options;
    options.prefix = prefix;
    auto group = ddp::init_process_group(transport == "shm" ? "ring" : transport, options);
    const int world = group.size(), me = group.rank();
    set_rank_for_lines(me);

    phase("allocate");
    // Several buffers, so that the window in which segments exist but are not yet mapped by
    // every rank is hit often.
    std::vector<ddp::group_buffer<float>> buffers;
    for (int b = 0; b < 4; ++b) buffers.push_back(group.allocate<float>(count));
    std::vector<float> heap(count / 4 + 3);

    phase("step");
    for (int step = 0; step < steps; ++step) {
      auto& buffer = buffers[static_cast<std::size_t>(step) % buffers.size()];
      fill(buffer.span(), me, step);
      group.all_reduce(buffer.span(), ddp::sum{});
      check(buffer.span(), world, step, "shared-buffer");
      fill(heap, me, step);
      group.all_reduce(std::span<float>(heap), ddp::sum{});
      check(heap, world, step, "heap-buffer");
    }

    phase("shutdown");
    group.barrier();
    buffers.clear();
    group = ddp::group();
    phase("done");
    return 0;
  } catch (const wrong_result& e) {
    timed_line("wrong result: " + e.what);
    return 3;
  } catch (const std::exception& e) {
    timed_line(std::string("error: ") + e.what());
    return 1;
  }
}
