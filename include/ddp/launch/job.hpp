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

#include <string>
#include <vector>

#include "ddp/core/compiled.hpp"
#include "ddp/launch/options.hpp"
#include "ddp/launch/result.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>

#include "ddp/core/deadline.hpp"
#include "ddp/core/env_registry.hpp"
#include "ddp/core/error.hpp"
#include "ddp/launch/child_env.hpp"
#include "ddp/launch/cpu_shares.hpp"
#include "ddp/launch/job_identity.hpp"
#include "ddp/launch/output.hpp"
#include "ddp/launch/process.hpp"
#include "ddp/launch/root_cause.hpp"
#include "ddp/launch/store_host.hpp"
#endif

namespace ddp {

/// Starts this node's workers running argv and supervises them until every one has ended.
/// See the top of this header for the variables, signals and exit code.
launch_result spawn(const launch_options& options, const std::vector<std::string>& argv);

/// spawn() with one store token for the whole job and up to max_restarts restarts of the
/// whole worker group after a failure (not after a signal to the launcher).
launch_result launch(const launch_options& options, const std::vector<std::string>& argv);

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
namespace detail {
/// The store token of a job (see "Tokens" above): the option, else DDP_STORE_TOKEN, else a fresh
/// random one on a single node; empty on several nodes without one (the store then accepts any
/// client, and spawn() warns).
inline std::string job_store_token(const launch_options& options) {
  if (!options.store_token.empty()) return options.store_token;
  if (const char* t = read_env_nonempty("DDP_STORE_TOKEN"); t != nullptr) return t;
  return options.nnodes == 1 ? random_hex(16) : std::string();
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
  const std::string token = detail::job_store_token(options);
  if (token.empty()) {
    detail::log_line(options, "warning: DDP_STORE_TOKEN is not set, so the store accepts any client; "
                              "export the same DDP_STORE_TOKEN on every node");
  }

  const std::string job_id = options.job_id.empty() ? detail::launcher_job_id(options.nnodes) : options.job_id;

  // The store's token as the launcher's server and client use it; nullopt: derived as the ranks do.
  const auto store_token = token.empty() ? std::optional<std::string>() : std::optional<std::string>(token);
  // Before the store's thread starts, so that it inherits the blocked signals.
  detail::signal_scope signals;
  // On one node the launcher serves the job's store (detail::host_store); otherwise, or when a
  // given port is taken, rank 0 does.
  std::unique_ptr<store::tcp_store_server> store_server;
  if (options.nnodes == 1 && world > 1) store_server = detail::host_store(options, result.master_addr, any_port, store_token, job_id);
  if (store_server) result.master_port = store_server->port();
  else result.master_port = any_port ? detail::pick_free_port(result.master_addr) : options.master_port;

  // Everything the children need is built before fork: after it they only make system calls.
  const std::vector<std::vector<std::string>> envs =
      detail::worker_environments(options, result.master_addr, result.master_port, token, job_id, store_server != nullptr);
  const auto c_array = [](const std::vector<std::string>& strings) {
    std::vector<char*> out;
    for (const auto& s : strings) out.push_back(const_cast<char*>(s.c_str()));
    out.push_back(nullptr);
    return out;
  };
  std::vector<char*> c_argv = c_array(argv);
  std::vector<std::vector<char*>> c_envs;
  for (const auto& e : envs) c_envs.push_back(c_array(e));

  std::vector<detail::cpu_share> cpu_share;
  if (options.bind_cpus) {
    std::string why_not;
    cpu_share = detail::cpu_shares(nproc, why_not);
    if (cpu_share.empty()) detail::log_line(options, "--cpu-bind cores: " + why_not);
  }

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
      if (!cpu_share.empty()) ::sched_setaffinity(0, sizeof(cpu_set_t), &cpu_share[static_cast<std::size_t>(local)].cpus);
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
    detail::report_departure(result.master_addr, result.master_port, store_token, job_id, "rank " + std::to_string(w.rank),
                             detail::departure_text(w, options.name));
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
  o.store_token = detail::job_store_token(o);  // one token for every restart
  for (int attempt = 0;; ++attempt) {
    o.restart_count = attempt;
    launch_result result = spawn(o, argv);
    result.restarts = attempt;
    if (result.ok() || result.signal != 0 || attempt >= o.max_restarts) return result;
    detail::log_line(o, "restarting the worker group (restart " + std::to_string(attempt + 1) + " of " +
                            std::to_string(o.max_restarts) + ")");
  }
}
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp
