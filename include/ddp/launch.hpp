#pragma once
// ddp::spawn / ddp::launch: the engine of a torchrun-compatible launcher (tools/ddprun, and
// `train_ddp --nproc-per-node N`, which launches itself the same way).
//
// spawn() starts nproc_per_node workers (fork + execve) with torchrun's variables set
// (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK,
// ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS)
// plus DDP_STORE_TOKEN, and supervises them until all have ended:
//  - each worker runs in its own process group (so its children can be signalled with it)
//    and has PR_SET_PDEATHSIG(SIGKILL), so it dies with the launcher even on SIGKILL;
//  - SIGINT / SIGTERM / SIGHUP sent to the launcher are forwarded to every worker's group; a
//    second one kills them at once;
//  - every worker's stderr passes through a pipe of the launcher (unchanged, or prefixed with
//    prefix_output), which keeps each worker's last non-empty line there;
//  - when a worker fails (non-zero exit or a signal), the others get settle_period to end on
//    their own (a peer that saw it die says so and exits), output still copied; then the
//    launcher sends SIGTERM to the groups still running, and SIGKILL after grace_period;
//  - when every worker has ended it names the root cause first: the earliest failure that is
//    not a consequence of another (a worker killed by a signal, or whose last error line is not
//    "peer rank N exited", "... closed the connection" and the like), else the earliest; then,
//    in rank order, every worker with a failure of its own or a last line on stderr, with that line:
//      ddprun: root cause: rank 0 (local 0, pid 1233) was killed by signal 9 (Killed)
//      ddprun: rank 0 (local 0, pid 1233) was killed by signal 9 (Killed)
//      ddprun: rank 1 (local 1, pid 1234) exited with code 1: ddp: rank 1: all_reduce #7 (...): peer rank 0 ...
//      ddprun: rank 2 (local 2, pid 1235) was killed by signal 15 (Terminated), stopped by ddprun: ...
//    A failure with nothing else to say is its one line, e.g.
//      ddprun: rank 1 (local 1, pid 1234) exited with code 3
//    Why the settle period: the ranks notice a peer's death themselves, and a SIGTERM at the
//    first failure would stop them before they say why;
//  - when a worker ends, whatever is left in its process group is killed (no orphans).
// The result's exit_code is 0 when every worker exited 0, else the root cause's code
// (128 + signal for a signal), or 128 + the signal that stopped the launcher.
// launch() adds the restarts (max_restarts) and one DDP_STORE_TOKEN for the whole job.
//
// Supervision is one poll() loop over a signalfd (SIGCHLD and the forwarded signals) and the
// workers' output pipes: no sleeps, no signal handlers. The signals are blocked in the
// calling thread while spawn() runs; call it from the main thread before other threads
// exist (or block those signals in them), so that no other thread takes SIGINT / SIGTERM.
// PR_SET_PDEATHSIG fires when the thread that forked exits, which is why spawn() must not
// run on a thread that ends before the job does.
//
// The store: on one node the launcher serves the job's store itself (DDP_STORE_SERVER=launcher;
// every rank is its client), bound before any worker starts: standalone (or master_port == 0)
// on a port the kernel picks, so no other process can take it in between. It outlives every
// rank, and when a worker ends first the launcher tells it so: every rank waiting on the store,
// in rendezvous say, fails at once naming that rank (store/detail/server_core.hpp,
// "Departures"), even one that died before it reached the store. On several nodes rank 0
// serves it, and standalone / master_port == 0 picks a free port by binding port 0 and closing it.
//
// Tokens: a single-node job gets a fresh random DDP_STORE_TOKEN (32 hex digits from
// /dev/urandom) unless one is already set; a multi-node job needs the same token on every
// node, so it passes through the launcher's DDP_STORE_TOKEN and warns when there is none.
// The token is never printed.
//
// Job identity: every worker gets DDP_JOB_ID, which its store checks at the handshake so that
// two jobs sharing a port never mix: options.job_id, else the launcher's own DDP_JOB_ID, else the
// job of the launcher that started ddprun (e.g. "slurm:1234.0" under srun), else, for a single
// node, "ddprun:<random>". A multi-node job without any of these runs without the check.
// launch() refuses to run as one of several tasks of srun or mpirun with --nnodes=1: each task
// would start a whole job of its own.
//
// With nproc_per_node > 1 and OMP_NUM_THREADS unset, workers get OMP_NUM_THREADS=1, as
// torchrun does (N workers each using every core would oversubscribe the machine).

#include <sys/types.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ddp/core/env_registry.hpp"
#include "ddp/core/compiled.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/env.hpp"
#include "ddp/core/error.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "ddp/launch/process.hpp"
#include "ddp/store/tcp_store.hpp"

extern char** environ;  // NOLINT: POSIX
#endif

namespace ddp {

struct launch_options {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;  // empty: 127.0.0.1, single node only
  int master_port = 29500;  // 0: a free loopback port
  bool standalone = false;  // one node, master 127.0.0.1, a free port
  int max_restarts = 0;     // launch() restarts the whole group up to this many times
  std::chrono::milliseconds grace_period = std::chrono::seconds(5);  // SIGTERM -> SIGKILL
  // First failure -> SIGTERM to the others, unless they all end before (see the top).
  std::chrono::milliseconds settle_period = std::chrono::milliseconds(500);
  bool prefix_output = false;  // "[rank N] " before each line the workers print
  std::string name = "ddprun";  // how the launcher's own lines start
  std::vector<std::pair<std::string, std::string>> env;  // more variables for every worker
  std::string store_token;  // empty: see "Tokens" above
  std::string job_id;       // empty: see "Job identity" above
  int restart_count = 0;    // TORCHELASTIC_RESTART_COUNT for this group (set by launch())
  std::FILE* log = stderr;  // where the launcher's own lines go
};

struct worker_status {
  int rank = -1;
  int local_rank = -1;
  pid_t pid = -1;
  bool ended = false;
  int exit_code = 0;  // when signal == 0
  int signal = 0;     // the signal that ended it
  bool exec_failed = false;
  bool stopped = false;     // it was still running when the launcher stopped the job
  std::string last_error;   // its last non-empty line on stderr
  bool ok() const noexcept { return ended && signal == 0 && exit_code == 0; }
  /// The exit code a shell would report: the code, or 128 + signal.
  int code() const noexcept { return signal != 0 ? 128 + signal : exit_code; }
  /// "rank 1 (local 1, pid 1234) exited with code 3" / "... was killed by signal 9 (Killed)".
  std::string describe() const;
};

struct launch_result {
  int exit_code = 0;
  std::vector<worker_status> workers;  // this node's workers, by local rank
  int failed = -1;   // local rank of the root cause (see the top); -1 when none failed on its own
  int signal = 0;    // the signal that stopped the launcher; 0 when none
  int restarts = 0;  // restarts launch() made
  std::string master_addr;
  int master_port = 0;
  bool ok() const noexcept { return exit_code == 0; }
};

/// Throws ddp::error(errc::config) naming the option that is wrong.
void validate(const launch_options& o);

/// Starts this node's workers running argv and supervises them until every one has ended.
/// See the top of this header for the variables, signals and exit code.
launch_result spawn(const launch_options& options, const std::vector<std::string>& argv);

/// spawn() with one store token for the whole job and up to max_restarts restarts of the
/// whole worker group after a failure (not after a signal to the launcher).
launch_result launch(const launch_options& options, const std::vector<std::string>& argv);

/// A parsed launcher command line: options, then the program and its arguments.
struct launcher_command {
  launch_options options;
  std::vector<std::string> program;   // empty with help or info
  bool help = false;
  bool info = false;
  std::vector<std::string> warnings;  // accepted but ignored options
};

std::string launcher_usage(std::string_view name = "ddprun");

/// Parses torchrun's flags; everything from the first non-option on is the program and its
/// arguments. A bad flag is a ddp::error(errc::invalid_argument) with one line to show.
launcher_command parse_launcher_args(const std::vector<std::string>& args);

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
DDP_COMPILED_INLINE std::string worker_status::describe() const {
  std::string s = "rank " + std::to_string(rank) + " (local " + std::to_string(local_rank) + ", pid " + std::to_string(pid) + ")";
  if (signal != 0) s += " was killed by signal " + detail::describe_signal(signal);
  else s += " exited with code " + std::to_string(exit_code);
  return s;
}

DDP_COMPILED_INLINE void validate(const launch_options& o) {
  const auto bad = [](std::string m) { throw error(errc::config, std::move(m)); };
  if (o.nproc_per_node < 1) bad("--nproc-per-node=" + std::to_string(o.nproc_per_node) + " must be at least 1");
  if (o.nnodes < 1) bad("--nnodes=" + std::to_string(o.nnodes) + " must be at least 1");
  if (o.node_rank < 0 || o.node_rank >= o.nnodes) {
    bad("--node-rank=" + std::to_string(o.node_rank) + " is out of range for --nnodes=" + std::to_string(o.nnodes) +
        " (expected 0 <= node rank < nnodes)");
  }
  if (o.standalone && o.nnodes > 1) {
    bad("--standalone runs one node; it cannot be combined with --nnodes=" + std::to_string(o.nnodes));
  }
  if (o.master_port < 0 || o.master_port > 65535) {
    bad("--master-port=" + std::to_string(o.master_port) + " is out of range (expected 1-65535)");
  }
  if (o.nnodes > 1 && o.master_addr.empty()) {
    bad("--nnodes=" + std::to_string(o.nnodes) + " needs --master-addr (the address of node 0, where rank 0 runs)");
  }
  if (o.nnodes > 1 && o.master_port == 0) bad("a multi-node job needs a fixed --master-port, the same on every node");
  if (o.max_restarts < 0) bad("--max-restarts=" + std::to_string(o.max_restarts) + " must be at least 0");
  if (o.grace_period.count() < 0) bad("the grace period must not be negative");
  if (o.settle_period.count() < 0) bad("the settle period must not be negative");
  if (static_cast<long long>(o.nproc_per_node) * o.nnodes > 1'000'000) bad("--nproc-per-node x --nnodes is too large");
}

namespace detail {

inline void log_line(const launch_options& o, const std::string& line) {
  if (o.log == nullptr) return;
  std::fprintf(o.log, "%s: %s\n", o.name.c_str(), line.c_str());
  std::fflush(o.log);
}

inline void write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the launcher's own output is gone: nothing better to do
    data.remove_prefix(static_cast<std::size_t>(n));
  }
}

/// One worker output stream being copied to ours, a prefix before each line.
struct output_pipe {
  unique_fd fd;
  int target = STDOUT_FILENO;
  std::string prefix;
  std::string partial;  // a line not yet ended
  bool keep_last = false;  // stderr: remember the last non-empty line
  int worker = -1;         // its local rank
  std::string last;

  /// Reads what is there; false at end of stream.
  bool pump() {
    char buf[65536];
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
    if (n <= 0) {
      flush();
      fd.reset();
      return false;
    }
    partial.append(buf, static_cast<std::size_t>(n));
    std::string out;
    std::size_t start = 0;
    for (std::size_t nl; (nl = partial.find('\n', start)) != std::string::npos; start = nl + 1) {
      out += prefix;
      out.append(partial, start, nl + 1 - start);
      remember(std::string_view(partial).substr(start, nl - start));
    }
    partial.erase(0, start);
    write_all(target, out);
    return true;
  }
  void flush() {
    if (!partial.empty()) {
      write_all(target, prefix + partial + "\n");
      remember(partial);
    }
    partial.clear();
  }
  void remember(std::string_view line) {
    if (!keep_last) return;
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t')) line.remove_suffix(1);
    if (line.empty()) return;
    constexpr std::size_t longest = 2000;  // a summary line, not a dump
    last.assign(line.substr(0, longest));
  }
};

/// What the launcher tells the job's store of a worker that ended: the other ranks' errors quote it.
inline std::string departure_text(const worker_status& w, std::string_view launcher) {
  return w.describe() + ", as " + std::string(launcher) + " saw";
}

/// Whether a worker's error line reports another rank's failure rather than a cause of its own
/// (`launcher`: the launcher's name, whose departure_text such a line may quote).
inline bool is_consequence(std::string_view line, std::string_view launcher) {
  for (std::string_view s : {"peer rank ", "closed the connection", "reset the connection", "was aborted",
                             "aborted the communicator", "unusable after an earlier failure", "noticed by rank",
                             "left the job without a word"}) {
    if (line.find(s) != std::string_view::npos) return true;
  }
  return line.find(", as " + std::string(launcher) + " saw") != std::string_view::npos;
}

}  // namespace detail

namespace detail {

/// The job identity a launcher hands its workers when none is given (see "Job identity").
inline std::string launcher_job_id(int nnodes) {
  if (const char* id = read_env("DDP_JOB_ID"); id != nullptr && *id != '\0') return id;
  try {
    if (auto outer = launch_environment::from_environment().job_id; !outer.empty()) return outer;
  } catch (const error&) {
    // An environment the launcher's own launcher left inconsistent: it identifies nothing.
  }
  return nnodes == 1 ? "ddprun:" + random_hex(8) : std::string();
}

/// A launcher started as one of several tasks (srun -n2 ddprun --nnodes=1) would run that many
/// separate jobs, each believing it is the whole job: refuse, in one line.
inline void check_not_one_of_many(const launch_options& o) {
  if (o.nnodes != 1) return;
  const auto count = [](const char* name) -> long long {
    const char* v = read_registered_env(name);
    if (v == nullptr || *v == '\0') return 0;
    const auto n = parse_int64(v);
    return n ? *n : 0;
  };
  for (const char* var : {"SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    if (const long long tasks = count(var); tasks > 1) {
      throw error(errc::config, o.name + " was started as one of " + std::to_string(tasks) + " tasks (" + var + "=" +
                                    std::to_string(tasks) + ") with --nnodes=1, so each task would run a whole job of its own: "
                                    "start one " + o.name + " per node with --nnodes=<nodes> --node-rank=<this node> "
                                    "(e.g. srun --ntasks-per-node=1 " + o.name + " --nnodes=$SLURM_NNODES "
                                    "--node-rank=$SLURM_NODEID ...), or let srun/mpirun start the ranks themselves");
    }
  }
}

/// After every worker has ended: takes each worker's last stderr line, picks the root cause
/// among the workers that failed on their own (see the top) and prints the summary.
inline void summarize(const launch_options& o, launch_result& result, const std::vector<output_pipe>& outputs,
                      const std::vector<clock::time_point>& ended_at) {
  for (const auto& p : outputs) {
    if (p.keep_last && p.worker >= 0) result.workers[static_cast<std::size_t>(p.worker)].last_error = p.last;
  }
  if (result.failed < 0) return;
  if (const auto& first = result.workers[static_cast<std::size_t>(result.failed)]; first.exec_failed || first.pid <= 0) return;
  // Ordered by the time each was reaped, not by when its line was printed: a line printed long
  // before the failure (progress on stderr) would otherwise look like the earliest failure.
  const auto own_failure = [&](const worker_status& w) { return w.ended && !w.ok() && !w.stopped && !w.exec_failed; };
  const auto cause_of_its_own = [&o](const worker_status& w) { return w.signal != 0 || !is_consequence(w.last_error, o.name); };
  int root = -1, earliest = -1;
  for (std::size_t i = 0; i < result.workers.size(); ++i) {
    const auto& w = result.workers[i];
    if (!own_failure(w)) continue;
    const auto before = [&](int other) { return other < 0 || ended_at[i] < ended_at[static_cast<std::size_t>(other)]; };
    if (before(earliest)) earliest = static_cast<int>(i);
    if (cause_of_its_own(w) && before(root)) root = static_cast<int>(i);
  }
  if (root < 0) root = earliest;
  if (root < 0) return;
  result.failed = root;
  const auto line_of = [&](const worker_status& w) {
    std::string s = w.describe();
    if (w.stopped) s += ", stopped by " + o.name;
    if (!w.last_error.empty()) s += ": " + w.last_error;
    return s;
  };
  // Every rank with something to say, in rank order; the cause first when it is not alone.
  std::vector<std::string> ranks;
  bool alone = true;
  for (const auto& w : result.workers) {
    if (w.pid <= 0 || !(own_failure(w) || !w.last_error.empty() || w.local_rank == root)) continue;
    ranks.push_back(line_of(w));
    alone = alone && w.local_rank == root;
  }
  if (!alone) log_line(o, "root cause: " + line_of(result.workers[static_cast<std::size_t>(root)]));
  for (const auto& line : ranks) log_line(o, line);
}

}  // namespace detail

DDP_COMPILED_INLINE launch_result spawn(const launch_options& options, const std::vector<std::string>& argv) {
  validate(options);
  if (argv.empty()) throw error(errc::config, "no program given (usage: ddprun [options] program [args...])");
  const std::string path = detail::find_executable(argv.front());

  launch_result result;
  const int nproc = options.nproc_per_node;
  const int world = nproc * options.nnodes;
  result.master_addr = options.standalone || options.master_addr.empty() ? "127.0.0.1" : options.master_addr;
  const bool any_port = options.standalone || options.master_port == 0;
  std::string token = options.store_token;
  if (token.empty()) {
    if (const char* t = read_env("DDP_STORE_TOKEN"); t != nullptr && *t != '\0') token = t;
    else if (options.nnodes == 1) token = detail::random_hex(16);
    else {
      detail::log_line(options, "warning: DDP_STORE_TOKEN is not set, so the store accepts any client; "
                                "export the same DDP_STORE_TOKEN on every node");
    }
  }

  const std::string job_id = options.job_id.empty() ? detail::launcher_job_id(options.nnodes) : options.job_id;

  // The store's token as the launcher's server and client use it; nullopt: derived as the ranks do.
  const auto store_token = token.empty() ? std::optional<std::string>() : std::optional<std::string>(token);
  // Before the store's thread starts, so that it inherits the blocked signals.
  detail::signal_scope signals;
  // On one node the launcher serves the job's store: it outlives any rank (rank 0's death does
  // not take it away), it is bound before any rank starts (no other process can take the port
  // in between), and the launcher tells it which rank ended (see report_departure below).
  // A given port that is taken leaves the store to rank 0, as on several nodes: its error names
  // the port's holder, and a job whose programs need no store still runs.
  std::unique_ptr<store::tcp_store_server> store_server;
  if (options.nnodes == 1 && world > 1) {
    try {
      store_server = std::make_unique<store::tcp_store_server>(store::tcp_store_server::options{
          .host = result.master_addr,
          .port = static_cast<std::uint16_t>(any_port ? 0 : options.master_port),
          .token = store_token,
          .log = [&options](const std::string& line) { detail::log_line(options, "store: " + line); },
          .job = job_id,
          .linger = std::chrono::milliseconds(0)});  // it stops after every worker has ended
    } catch (const error& e) {
      if (any_port || e.code() != errc::config) throw;
    }
  }
  if (store_server) result.master_port = store_server->port();
  else result.master_port = any_port ? detail::pick_free_port(result.master_addr) : options.master_port;

  // Everything the children need is built before fork: after it they only make system calls.
  std::vector<std::string> names = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "DDP_STORE_TOKEN", "DDP_JOB_ID",
                                    "DDP_STORE_SERVER"};
  for (const auto& [k, v] : options.env) names.push_back(k);
  const bool set_omp = nproc > 1 && read_env("OMP_NUM_THREADS") == nullptr;
  if (set_omp) names.push_back("OMP_NUM_THREADS");
  std::vector<std::string> inherited;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const std::string_view key = entry.substr(0, entry.find('='));
    if (std::find(names.begin(), names.end(), key) == names.end()) inherited.emplace_back(entry);
  }
  std::vector<std::vector<std::string>> envs(static_cast<std::size_t>(nproc));
  for (int local = 0; local < nproc; ++local) {
    auto& e = envs[static_cast<std::size_t>(local)];
    e = inherited;
    const int rank = options.node_rank * nproc + local;
    const auto set = [&e](const std::string& k, const std::string& v) { e.push_back(k + "=" + v); };
    set("RANK", std::to_string(rank));
    set("LOCAL_RANK", std::to_string(local));
    set("WORLD_SIZE", std::to_string(world));
    set("LOCAL_WORLD_SIZE", std::to_string(nproc));
    set("GROUP_RANK", std::to_string(options.node_rank));
    set("GROUP_WORLD_SIZE", std::to_string(options.nnodes));
    set("ROLE_RANK", std::to_string(rank));
    set("ROLE_WORLD_SIZE", std::to_string(world));
    set("MASTER_ADDR", result.master_addr);
    set("MASTER_PORT", std::to_string(result.master_port));
    set("TORCHELASTIC_RESTART_COUNT", std::to_string(options.restart_count));
    set("TORCHELASTIC_MAX_RESTARTS", std::to_string(options.max_restarts));
    if (!token.empty()) set("DDP_STORE_TOKEN", token);
    if (!job_id.empty()) set("DDP_JOB_ID", job_id);
    if (store_server) set("DDP_STORE_SERVER", "launcher");
    if (set_omp) set("OMP_NUM_THREADS", "1");
    for (const auto& [k, v] : options.env) set(k, v);
  }
  const auto c_array = [](const std::vector<std::string>& strings) {
    std::vector<char*> out;
    for (const auto& s : strings) out.push_back(const_cast<char*>(s.c_str()));
    out.push_back(nullptr);
    return out;
  };
  std::vector<char*> c_argv = c_array(argv);
  std::vector<std::vector<char*>> c_envs;
  for (const auto& e : envs) c_envs.push_back(c_array(e));

  const pid_t parent = ::getpid();
  result.workers.resize(static_cast<std::size_t>(nproc));
  std::vector<detail::output_pipe> outputs;
  int live = 0;
  bool stopping = false;
  deadline kill_at = deadline::never();
  deadline settle_until = deadline::never();  // after the first failure, until SIGTERM
  std::vector<clock::time_point> ended_at(static_cast<std::size_t>(nproc));

  // Sends sig to the process group of every worker that is still running.
  const auto signal_all = [&](int sig) {
    for (const auto& w : result.workers)
      if (w.pid > 0 && !w.ended) ::kill(-w.pid, sig);
  };
  const auto begin_stop = [&](int sig) {
    stopping = true;
    for (auto& w : result.workers)
      if (w.pid > 0 && !w.ended) w.stopped = true;
    signal_all(sig);
    kill_at = deadline::after(options.grace_period);
  };

  for (int local = 0; local < nproc; ++local) {
    auto& w = result.workers[static_cast<std::size_t>(local)];
    w.rank = options.node_rank * nproc + local;
    w.local_rank = local;
    auto [exec_read, exec_write] = detail::make_pipe();
    detail::unique_fd out_read, out_write, err_read, err_write;
    if (options.prefix_output) std::tie(out_read, out_write) = detail::make_pipe();
    std::tie(err_read, err_write) = detail::make_pipe();  // always: its last line goes in the summary
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int err = errno;
      begin_stop(SIGKILL);
      detail::log_line(options, system_message("fork failed for rank " + std::to_string(w.rank), err));
      w.ended = true;
      w.exit_code = 1;
      result.failed = local;
      break;
    }
    if (pid == 0) {
      // The child: async-signal-safe calls only, then exec.
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(128 + SIGKILL);  // the launcher died before prctl
      struct sigaction dfl{};
      dfl.sa_handler = SIG_DFL;
      sigemptyset(&dfl.sa_mask);
      for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) ::sigaction(s, &dfl, nullptr);
      ::pthread_sigmask(SIG_SETMASK, &signals.original_mask(), nullptr);
      const auto redirect = [](int from, int to) {
        if (from == to) ::fcntl(to, F_SETFD, 0);  // keep it open across exec
        else ::dup2(from, to);
      };
      if (out_write) redirect(out_write.get(), STDOUT_FILENO);
      if (err_write) redirect(err_write.get(), STDERR_FILENO);
      ::execve(path.c_str(), c_argv.data(), c_envs[static_cast<std::size_t>(local)].data());
      const int err = errno;
      [[maybe_unused]] const ssize_t n = ::write(exec_write.get(), &err, sizeof err);
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here, so that the group exists before we signal it
    w.pid = pid;
    ++live;
    exec_write.reset();
    out_write.reset();
    err_write.reset();
    // The exec pipe closes when execve succeeds, or carries its errno.
    int err = 0;
    pollfd p{exec_read.get(), POLLIN, 0};
    if (::poll(&p, 1, 30'000) > 0 && ::read(exec_read.get(), &err, sizeof err) == static_cast<ssize_t>(sizeof err)) {
      w.exec_failed = true;
      result.failed = local;
      begin_stop(SIGTERM);
      detail::log_line(options, "rank " + std::to_string(w.rank) + ": " + system_message("cannot execute '" + path + "'", err));
    }
    const std::string prefix = "[rank " + std::to_string(w.rank) + "] ";
    const auto add_output = [&](detail::unique_fd fd, int target, bool keep_last) {
      auto& out = outputs.emplace_back();
      out.fd = std::move(fd);
      out.target = target;
      if (options.prefix_output) out.prefix = prefix;
      out.keep_last = keep_last;
      out.worker = local;
    };
    if (out_read) add_output(std::move(out_read), STDOUT_FILENO, false);
    add_output(std::move(err_read), STDERR_FILENO, true);
    if (w.exec_failed) break;
  }

  // The first failure is told to the job's store (held by global rank 0), so that every rank
  // waiting there, in rendezvous say, names the rank that ended at once, even one that died
  // before it reached the store (store/detail/server_core.hpp, "Departures"). Bounded: the
  // store's host may be the one that ended.
  const auto report_departure = [&](const worker_status& w) {
    if ((w.rank == 0 && !store_server) || world < 2) return;
    try {
      store::tcp_store st({.host = result.master_addr, .port = static_cast<std::uint16_t>(result.master_port),
                           .timeout = std::chrono::milliseconds(300),
                           .token = store_token,
                           .job = job_id});
      st.report_departure("rank " + std::to_string(w.rank), detail::departure_text(w, options.name));
    } catch (const std::exception&) {  // the store is a courtesy channel: the summary still names the cause
    }
  };
  bool reported = false;
  deadline report_at = deadline::never();
  constexpr auto report_delay = std::chrono::milliseconds(50);
  // Records each worker that has ended. The first failure starts the settle period (the root
  // cause is chosen when all have ended); its end, or a settle period of 0, stops the others.
  const auto reap = [&] {
    const bool none_failed_before = result.failed < 0;
    for (std::size_t i = 0; i < result.workers.size(); ++i) {
      auto& w = result.workers[i];
      if (w.pid <= 0 || w.ended) continue;
      int status = 0;
      const pid_t got = ::waitpid(w.pid, &status, WNOHANG);
      if (got != w.pid) continue;
      w.ended = true;
      ended_at[i] = clock::now();
      --live;
      if (WIFSIGNALED(status)) w.signal = WTERMSIG(status);
      else if (WIFEXITED(status)) w.exit_code = WEXITSTATUS(status);
      ::kill(-w.pid, SIGKILL);  // what it left behind in its group
      if (!w.ok() && !w.stopped && result.failed < 0) result.failed = static_cast<int>(i);
      // A death by signal is told at once; an exit with an error code may be a rank that saw
      // such a death before the launcher reaped it, so it is told only if no death by signal
      // follows within report_delay.
      if (!reported && !w.ok() && !w.stopped && w.signal != 0) {
        report_departure(w);
        reported = true;
      }
    }
    if (none_failed_before && result.failed >= 0 && !reported) report_at = deadline::after(report_delay);
    if (result.failed >= 0 && !stopping && settle_until.is_never()) {
      if (options.settle_period.count() == 0) begin_stop(SIGTERM);
      else settle_until = deadline::after(options.settle_period);
    }
  };
  deadline drain_until = deadline::never();
  while (true) {
    reap();
    if (!reported && report_at.expired()) {
      report_departure(result.workers[static_cast<std::size_t>(result.failed)]);
      reported = true;
    }
    std::size_t open = 0;
    for (const auto& o : outputs) open += o.fd ? 1 : 0;
    if (live == 0 && open == 0) break;
    if (live == 0 && drain_until.is_never()) {
      // Every worker ended; what still holds a pipe escaped its group. Bound the wait for it.
      drain_until = deadline::after(std::chrono::seconds(1));
    }
    if (live == 0 && drain_until.expired()) {
      for (auto& o : outputs) {
        o.flush();
        o.fd.reset();
      }
      break;
    }
    if (live > 0 && !stopping && settle_until.expired()) begin_stop(SIGTERM);
    if (live > 0 && kill_at.expired()) {
      for (const auto& w : result.workers) {
        if (w.pid > 0 && !w.ended) {
          detail::log_line(options, "rank " + std::to_string(w.rank) + " (local " + std::to_string(w.local_rank) + ", pid " +
                                std::to_string(w.pid) + ") did not stop within " +
                                std::to_string(options.grace_period.count()) + " ms; sending SIGKILL");
        }
      }
      signal_all(SIGKILL);
      kill_at = deadline::never();
    }
    std::vector<pollfd> fds;
    fds.push_back({signals.fd(), POLLIN, 0});
    std::vector<std::size_t> which;
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].fd) {
        fds.push_back({outputs[i].fd.get(), POLLIN, 0});
        which.push_back(i);
      }
    }
    const deadline wake = live > 0 ? (stopping ? kill_at : settle_until) : drain_until;
    int timeout_ms = wake.poll_timeout_ms();
    if (!reported && !report_at.is_never()) timeout_ms = timeout_ms < 0 ? report_at.poll_timeout_ms() : std::min(timeout_ms, report_at.poll_timeout_ms());
    const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno != EINTR) throw error(errc::internal, system_message("poll"));
    if (ready <= 0) continue;
    if (fds[0].revents != 0) {
      for (int sig; (sig = signals.next()) != 0;) {
        if (sig == SIGCHLD) continue;  // reap() at the top of the loop
        if (result.signal == 0) {
          result.signal = sig;
          detail::log_line(options, std::string("received SIG") + ::sigabbrev_np(sig) + ", stopping " + std::to_string(live) +
                                " worker" + (live == 1 ? "" : "s"));
          begin_stop(sig);
        } else {
          signal_all(SIGKILL);  // a second signal: no more waiting
        }
      }
    }
    for (std::size_t k = 1; k < fds.size(); ++k) {
      if (fds[k].revents != 0) outputs[which[k - 1]].pump();
    }
  }

  detail::summarize(options, result, outputs, ended_at);
  if (result.signal != 0) result.exit_code = 128 + result.signal;
  else if (result.failed >= 0) result.exit_code = result.workers[static_cast<std::size_t>(result.failed)].exec_failed
                                                      ? 127
                                                      : result.workers[static_cast<std::size_t>(result.failed)].code();
  else {
    for (const auto& w : result.workers) {
      if (!w.ok()) {
        result.exit_code = w.exec_failed ? 127 : w.code();
        break;
      }
    }
  }
  return result;
}

DDP_COMPILED_INLINE launch_result launch(const launch_options& options, const std::vector<std::string>& argv) {
  launch_options o = options;
  validate(o);
  detail::check_not_one_of_many(o);
  if (o.job_id.empty()) o.job_id = detail::launcher_job_id(o.nnodes);
  if (o.store_token.empty()) {
    if (const char* t = read_env("DDP_STORE_TOKEN"); t != nullptr && *t != '\0') o.store_token = t;
    else if (o.nnodes == 1) o.store_token = detail::random_hex(16);
  }
  for (int attempt = 0;; ++attempt) {
    o.restart_count = attempt;
    launch_result result = spawn(o, argv);
    result.restarts = attempt;
    if (result.ok() || result.signal != 0 || attempt >= o.max_restarts) return result;
    detail::log_line(o, "restarting the worker group (restart " + std::to_string(attempt + 1) + " of " +
                            std::to_string(o.max_restarts) + ")");
  }
}

DDP_COMPILED_INLINE std::string launcher_usage(std::string_view name) {
  const std::string n(name);
  return "usage: " + n + " [options] program [args...]\n"
         "Starts --nproc-per-node copies of program with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,\n"
         "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) and DDP_STORE_TOKEN set. When one fails, the\n"
         "others get the settle period to end, then are stopped (SIGTERM, then SIGKILL after the grace period);\n"
         + n + " names the root cause first, then every rank's last error line, and exits with the cause's code.\n"
         "Options (--flag value and --flag=value; '_' and '-' are the same in names):\n"
         "  --standalone              one node, rendezvous on 127.0.0.1 at a free port\n"
         "  --nnodes N                number of nodes (also N:N) [1]\n"
         "  --nproc-per-node N        workers on this node; auto or cpu = number of CPUs [1]\n"
         "  --node-rank N             this node's rank, 0 <= N < nnodes [0]\n"
         "  --master-addr ADDR        address of node 0 (required with --nnodes > 1) [127.0.0.1]\n"
         "  --master-port PORT        rendezvous port [29500; a free port with --standalone]\n"
         "  --max-restarts N          restart the whole worker group up to N times after a failure [0]\n"
         "  --grace-period SECONDS    time between SIGTERM and SIGKILL when stopping workers [5]\n"
         "  --settle-period SECONDS   after a worker fails, time the others get to end on their own (and say\n"
         "                            why) before SIGTERM; then the root cause is named first [0.5]\n"
         "  --prefix-output, --tee    prefix each output line with [rank N]\n"
         "  --no-python               accepted for torchrun compatibility (programs always run directly)\n"
         "  --rdzv-backend, --rdzv-endpoint, --rdzv-id, --rdzv-conf, --monitor-interval, --start-method,\n"
         "  --role, --log-dir, --redirects, --local-addr\n"
         "                            accepted and ignored, with a warning\n"
         "  --info                    print ddp's version, backends, devices and the launch environment\n"
         "  -h, --help                this text\n"
         "Example: " + n + " --standalone --nproc-per-node=2 ./train_ddp --epochs 3\n";
}

DDP_COMPILED_INLINE launcher_command parse_launcher_args(const std::vector<std::string>& args) {
  launcher_command cmd;
  auto& o = cmd.options;
  const auto bad = [](std::string m) { throw error(errc::invalid_argument, std::move(m)); };
  const auto number = [&bad](const std::string& flag, const std::string& text, int min_value) {
    const auto v = detail::parse_int64(text);
    if (!v || *v < min_value || *v > 1'000'000'000) {
      bad(flag + "='" + text + "' is not " + (min_value > 0 ? "a positive" : "a non-negative") + " integer");
    }
    return static_cast<int>(*v);
  };
  std::size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      cmd.help = true;
      return cmd;
    }
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) {
      if (!arg.empty() && arg[0] == '-' && arg != "-") bad("unknown option '" + arg + "' (see --help)");
      break;  // the program
    }
    // --name=value or --name value; '_' in names is '-'.
    const std::size_t eq = arg.find('=');
    std::string flag = arg.substr(0, eq);
    std::replace(flag.begin() + 2, flag.end(), '_', '-');
    const bool inline_value = eq != std::string::npos;
    const auto value = [&]() -> std::string {
      if (inline_value) return arg.substr(eq + 1);
      if (i + 1 >= args.size()) bad("option '" + flag + "' needs a value");
      return args[++i];
    };
    const auto no_value = [&] {
      if (inline_value) bad("option '" + flag + "' takes no value");
    };
    if (flag == "--standalone") {
      no_value();
      o.standalone = true;
    } else if (flag == "--nnodes") {
      const std::string v = value();
      const std::size_t colon = v.find(':');
      if (colon == std::string::npos) {
        o.nnodes = number(flag, v, 1);
      } else {
        const int lo = number(flag, v.substr(0, colon), 1);
        const int hi = number(flag, v.substr(colon + 1), 1);
        if (lo != hi) bad("--nnodes='" + v + "': elastic node ranges are not supported (expected N or N:N)");
        o.nnodes = lo;
      }
    } else if (flag == "--nproc-per-node") {
      const std::string v = value();
      if (v == "auto" || v == "cpu") {
        cpu_set_t set;
        CPU_ZERO(&set);
        const int cpus = ::sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
        o.nproc_per_node = cpus > 0 ? cpus : std::max(1, static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)));
      } else if (v == "gpu") {
        bad("--nproc-per-node=gpu needs the CUDA build; give a number");
      } else {
        const auto n = detail::parse_int64(v);
        if (!n || *n < 1 || *n > 1'000'000) bad("--nproc-per-node='" + v + "' is not a positive integer, 'auto' or 'cpu'");
        o.nproc_per_node = static_cast<int>(*n);
      }
    } else if (flag == "--node-rank") {
      o.node_rank = number(flag, value(), 0);
    } else if (flag == "--master-addr") {
      o.master_addr = value();
      if (o.master_addr.empty()) bad("--master-addr is empty");
    } else if (flag == "--master-port") {
      const std::string v = value();
      const auto p = detail::parse_int64(v);
      if (!p || *p < 1 || *p > 65535) bad("--master-port='" + v + "' is out of range (expected 1-65535)");
      o.master_port = static_cast<int>(*p);
    } else if (flag == "--max-restarts") {
      o.max_restarts = number(flag, value(), 0);
    } else if (flag == "--grace-period" || flag == "--settle-period") {
      const std::string v = value();
      char* end = nullptr;
      const double seconds = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || !(seconds >= 0) || seconds > 1e6) {
        bad(flag + "='" + v + "' is not a number of seconds");
      }
      (flag == "--grace-period" ? o.grace_period : o.settle_period) =
          std::chrono::milliseconds(static_cast<long long>(seconds * 1000 + 0.5));
    } else if (flag == "--prefix-output") {
      no_value();
      o.prefix_output = true;
    } else if (flag == "--tee") {
      // torchrun's --tee takes 0-3 (which streams); any non-zero value turns prefixing on.
      if (inline_value || (i + 1 < args.size() && args[i + 1].size() == 1 && args[i + 1][0] >= '0' && args[i + 1][0] <= '3')) {
        o.prefix_output = value() != "0";
      } else {
        o.prefix_output = true;
      }
    } else if (flag == "--no-python") {
      no_value();
    } else if (flag == "--info") {
      no_value();
      cmd.info = true;
    } else if (flag.rfind("--rdzv-", 0) == 0 || flag == "--monitor-interval" || flag == "--start-method" ||
               flag == "--role" || flag == "--log-dir" || flag == "--redirects" || flag == "--local-addr" ||
               flag == "--local-ranks-filter") {
      const std::string v = value();
      cmd.warnings.push_back("ignoring " + flag + "=" + v + " (ddprun has no elastic rendezvous; it uses MASTER_ADDR:MASTER_PORT)");
    } else if (flag == "--module") {
      bad("--module runs Python modules; ddprun runs programs (give the program's path)");
    } else {
      bad("unknown option '" + flag + "' (see --help)");
    }
  }
  cmd.program.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  if (cmd.program.empty() && !cmd.info) bad("no program given (usage: ddprun [options] program [args...])");
  return cmd;
}
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp
