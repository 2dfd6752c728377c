#pragma once
// Test worker for the launcher tests, and helpers to run and inspect processes.
//
// A test binary that includes this header becomes its own worker: started as
//   <binary> --ddp-test-worker MODE ARGS...
// a static initializer runs the mode and _exits before Catch's main. Modes:
//   env DIR                     write DIR/<rank>.env with the launch variables, print them
//   block DIR N                 record pids (its own and a grandchild's) in DIR/<rank>.pid, print
//                               "ready <rank>", wait forever
//   fail DIR N RANK CODE        as block, and once all N have recorded their pids, rank RANK exits CODE
//   killself DIR N RANK         as fail, but rank RANK raises SIGKILL
//   stubborn DIR N RANK CODE    as fail, and the others ignore SIGTERM
//   hold-port                   rank 0 binds 127.0.0.1:MASTER_PORT, prints "port P bound", waits for
//                               EOF on stdin
//   fail-once RANK CODE         on the first attempt (TORCHELASTIC_RESTART_COUNT=0) rank RANK exits CODE
//   echo                        prints "hello from rank R" and an unterminated "tail R"
//   cpus                        prints "rank R cpus C,C,..." (the CPUs it may run on)
//   check-env                   reads the launch environment; prints the error and exits 1 if bad
// Waiting is done with inotify, poll and pause: no sleeps.

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <ddp/core/env.hpp>

namespace ddp::test {

inline std::string env_or(const char* name, const char* fallback = "") {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}

inline void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << text;
  }
  std::rename(tmp.c_str(), path.c_str());
}

/// Number of files in dir whose name ends with suffix.
inline int count_files(const std::string& dir, const std::string& suffix) {
  int n = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) ++n;
    }
    ::closedir(d);
  }
  return n;
}

/// Waits (inotify, bounded) until dir holds n files ending in suffix.
inline bool wait_for_files(const std::string& dir, const std::string& suffix, int n, std::chrono::milliseconds timeout) {
  const int in = ::inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  if (in < 0) return false;
  ::inotify_add_watch(in, dir.c_str(), IN_MOVED_TO | IN_CLOSE_WRITE | IN_CREATE);
  const auto until = std::chrono::steady_clock::now() + timeout;
  bool ok = false;
  while (true) {
    if (count_files(dir, suffix) >= n) {
      ok = true;
      break;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{in, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) > 0) {
      char buf[4096];
      while (::read(in, buf, sizeof buf) > 0) {
      }
    }
  }
  ::close(in);
  return ok;
}

[[noreturn]] inline void wait_forever() {
  while (true) ::pause();
}

inline int worker_main(const std::vector<std::string>& args) {
  const std::string mode = args.empty() ? "" : args[0];
  const int rank = std::atoi(env_or("RANK", "-1").c_str());
  const auto arg = [&args](std::size_t i) { return i < args.size() ? args[i] : std::string(); };

  if (mode == "env") {
    std::ostringstream s;
    for (const char* k : {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                          "MASTER_ADDR", "MASTER_PORT", "DDP_STORE_TOKEN", "DDP_JOB_ID", "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS"}) {
      s << k << "=" << env_or(k) << "\n";
    }
    try {
      const auto env = ddp::launch_environment::from_environment();
      s << "parsed=" << ddp::to_string(env.source()) << " " << env.rank << " " << env.world_size << " " << env.local_rank
        << " " << env.local_world_size << " " << env.master_addr << ":" << env.master_port << "\n";
      s << "job=" << env.job_id << "\n";
    } catch (const std::exception& e) {
      s << "parsed=error " << e.what() << "\n";
    }
    s << "pid=" << ::getpid() << "\n";
    std::printf("worker %s", s.str().c_str());
    std::fflush(stdout);
    write_file_atomically(arg(1) + "/" + std::to_string(rank) + ".env", s.str());
    return 0;
  }
  if (mode == "block" || mode == "fail" || mode == "killself" || mode == "stubborn") {
    const std::string dir = arg(1);
    const int n = std::atoi(arg(2).c_str());
    const int target = args.size() > 3 ? std::atoi(arg(3).c_str()) : -1;
    if (mode == "stubborn" && rank != target) ::signal(SIGTERM, SIG_IGN);
    const pid_t grandchild = ::fork();
    if (grandchild == 0) wait_forever();  // stays in the worker's process group
    write_file_atomically(dir + "/" + std::to_string(rank) + ".pid",
                          std::to_string(::getpid()) + " " + std::to_string(grandchild) + "\n");
    std::printf("ready %d\n", rank);
    std::fflush(stdout);
    if (rank == target) {
      if (!wait_for_files(dir, ".pid", n, std::chrono::seconds(60))) return 99;
      if (mode == "killself") ::raise(SIGKILL);
      return std::atoi(arg(4).c_str());
    }
    wait_forever();
  }
  if (mode == "hold-port") {
    if (rank != 0) return 0;
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<std::uint16_t>(std::atoi(env_or("MASTER_PORT").c_str())));
    ::inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || ::listen(fd, 1) != 0) {
      std::printf("cannot bind 127.0.0.1:%s: %s\n", env_or("MASTER_PORT").c_str(), std::strerror(errno));
      return 1;
    }
    std::printf("port %s bound\n", env_or("MASTER_PORT").c_str());
    std::fflush(stdout);
    char c;
    while (::read(STDIN_FILENO, &c, 1) > 0) {
    }
    return 0;
  }
  if (mode == "fail-once") {
    const int attempt = std::atoi(env_or("TORCHELASTIC_RESTART_COUNT", "0").c_str());
    std::printf("attempt %d rank %d\n", attempt, rank);
    return attempt == 0 && rank == std::atoi(arg(1).c_str()) ? std::atoi(arg(2).c_str()) : 0;
  }
  if (mode == "cpus") {  // the CPUs this worker may run on, one line
    cpu_set_t set;
    CPU_ZERO(&set);
    if (::sched_getaffinity(0, sizeof set, &set) != 0) return 1;
    std::string list;
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) list += (list.empty() ? "" : ",") + std::to_string(c);
    std::printf("rank %d cpus %s\n", rank, list.c_str());
    return 0;
  }
  if (mode == "echo") {
    std::printf("hello from rank %d\n", rank);
    std::fprintf(stderr, "error line from rank %d\n", rank);
    std::printf("tail %d", rank);
    return 0;
  }
  if (mode == "check-env") {
    try {
      (void)ddp::launch_environment::from_environment();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 1;
    }
    return 0;
  }
  std::fprintf(stderr, "unknown worker mode '%s'\n", mode.c_str());
  return 98;
}

/// Runs worker_main and exits when this process was started as a worker.
inline bool run_as_worker_if_asked() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> argv;
  for (std::string a; std::getline(in, a, '\0');) argv.push_back(a);
  if (argv.size() < 2 || argv[1] != "--ddp-test-worker") return false;
  std::fflush(nullptr);
  const int code = worker_main(std::vector<std::string>(argv.begin() + 2, argv.end()));
  std::fflush(nullptr);
  ::_exit(code);
}

inline const bool worker_dispatch = run_as_worker_if_asked();

/// The path of this test binary, for workers to run.
inline std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string("/proc/self/exe");
}

/// A fresh directory under /tmp, removed (with its files) on destruction.
struct temp_dir {
  std::string path;
  temp_dir() {
    char tmpl[] = "/tmp/ddp-launch-test-XXXXXX";
    const char* p = ::mkdtemp(tmpl);
    path = p != nullptr ? p : "/tmp";
  }
  ~temp_dir() {
    if (DIR* d = ::opendir(path.c_str())) {
      while (const dirent* e = ::readdir(d)) {
        const std::string name = e->d_name;
        if (name != "." && name != "..") ::unlink((path + "/" + name).c_str());
      }
      ::closedir(d);
    }
    ::rmdir(path.c_str());
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
};

/// The "pid grandchild" pairs that block/fail workers recorded, by rank.
inline std::map<int, std::vector<pid_t>> recorded_pids(const std::string& dir) {
  std::map<int, std::vector<pid_t>> out;
  for (int r = 0; r < 1024; ++r) {
    std::ifstream in(dir + "/" + std::to_string(r) + ".pid");
    if (!in) continue;
    pid_t a = 0, b = 0;
    in >> a >> b;
    out[r] = {a, b};
  }
  return out;
}

/// The fields of /proc/PID/stat after the command name ("S 1234 ...": state, parent pid, ...);
/// empty when there is no such process.
inline std::string stat_fields(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!in || !std::getline(in, stat)) return {};
  const auto close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return {};
  return stat.substr(close + 2);
}

/// True while pid names a process that has not ended (a zombie counts as ended).
inline bool process_alive(pid_t pid) {
  const std::string fields = stat_fields(pid);
  return !fields.empty() && fields[0] != 'Z' && fields[0] != 'X';
}

/// The ranks a launcher started: its children that carry RANK in their environment, by rank.
/// Looks (until `timeout`) for `n` of them: a child is only seen once it has exec'd.
inline std::map<int, pid_t> children_by_rank(pid_t launcher, std::size_t n, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  std::map<int, pid_t> found;
  while (found.size() < n && std::chrono::steady_clock::now() < until) {
    DIR* proc = ::opendir("/proc");
    if (proc == nullptr) break;
    while (const dirent* e = ::readdir(proc)) {
      const pid_t pid = static_cast<pid_t>(std::atoi(e->d_name));
      if (pid <= 0) continue;
      std::istringstream fields(stat_fields(pid));
      char state = 0;
      long ppid = 0;
      if (!(fields >> state >> ppid) || ppid != launcher) continue;
      std::ifstream environ("/proc/" + std::to_string(pid) + "/environ");
      for (std::string var; std::getline(environ, var, '\0');)
        if (var.rfind("RANK=", 0) == 0) found[std::stoi(var.substr(5))] = pid;
    }
    ::closedir(proc);
  }
  return found;
}

/// Waits (bounded) until process pid has ended; true when it has. Works for any process, not
/// only children: a pidfd becomes readable when its process terminates.
inline bool wait_process_end(pid_t pid, std::chrono::milliseconds timeout) {
  const int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) return errno == ESRCH || !process_alive(pid);
  pollfd p{fd, POLLIN, 0};
  const int ready = ::poll(&p, 1, static_cast<int>(timeout.count()));
  ::close(fd);
  return ready > 0 || !process_alive(pid);
}

/// Pids among `pids` still alive after waiting up to `timeout` for them to end. Orphaned
/// grandchildren are killed and then reaped by init, which may take a moment.
inline std::vector<pid_t> survivors(const std::vector<pid_t>& pids, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  std::vector<pid_t> alive;
  for (pid_t p : pids) {
    if (p <= 0) continue;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (!wait_process_end(p, std::max(left, std::chrono::milliseconds(0)))) alive.push_back(p);
  }
  return alive;
}

/// A child process with its stdout and stderr captured, and optionally a pipe on its stdin.
class child_process {
 public:
  child_process(const std::vector<std::string>& argv, const std::vector<std::pair<std::string, std::string>>& env = {},
                bool stdin_pipe = false) {
    int out[2], err[2], in[2] = {-1, -1};
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
    if (stdin_pipe && ::pipe2(in, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    std::fflush(nullptr);
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork");
    if (pid_ == 0) {
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      if (in[0] >= 0) ::dup2(in[0], STDIN_FILENO);
      for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    ::close(out[1]);
    ::close(err[1]);
    out_ = out[0];
    err_ = err[0];
    if (in[0] >= 0) {
      ::close(in[0]);
      in_ = in[1];
    }
  }
  ~child_process() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    for (int fd : {out_, err_, in_})
      if (fd >= 0) ::close(fd);
  }
  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;

  pid_t pid() const { return pid_; }
  void close_stdin() {
    if (in_ >= 0) ::close(in_);
    in_ = -1;
  }

  /// Reads output until stdout contains `count` occurrences of `needle`, or the timeout.
  bool wait_for_output(const std::string& needle, int count, std::chrono::milliseconds timeout) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (occurrences(out_text, needle) < count) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0 || !pump(static_cast<int>(left.count()))) return occurrences(out_text, needle) >= count;
    }
    return true;
  }

  /// Waits for the process to exit (SIGKILL at the timeout); reads all output. Returns the
  /// shell-style code (128 + signal), or -1 when it had to be killed.
  int wait(std::chrono::milliseconds timeout) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (out_ >= 0 || err_ >= 0) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0 || !pump(static_cast<int>(left.count()))) break;
    }
    int status = 0;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (!wait_process_end(pid_, std::max(left, std::chrono::milliseconds(0)))) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
      reaped_ = true;
      return -1;
    }
    ::waitpid(pid_, &status, 0);
    reaped_ = true;
    return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
  }

  std::string out_text, err_text;

 private:
  static int occurrences(const std::string& text, const std::string& needle) {
    int n = 0;
    for (std::size_t p = text.find(needle); p != std::string::npos; p = text.find(needle, p + needle.size())) ++n;
    return n;
  }
  // One poll over the open pipes; false when nothing is open or the wait timed out.
  bool pump(int timeout_ms) {
    std::vector<pollfd> fds;
    if (out_ >= 0) fds.push_back({out_, POLLIN, 0});
    if (err_ >= 0) fds.push_back({err_, POLLIN, 0});
    if (fds.empty()) return false;
    const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready == 0) return false;
    if (ready < 0) return errno == EINTR;
    for (const auto& p : fds) {
      if (p.revents == 0) continue;
      char buf[4096];
      const ssize_t n = ::read(p.fd, buf, sizeof buf);
      std::string& text = p.fd == out_ ? out_text : err_text;
      int& fd = p.fd == out_ ? out_ : err_;
      if (n > 0) {
        text.append(buf, static_cast<std::size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(fd);
        fd = -1;
      }
    }
    return true;
  }

  pid_t pid_ = -1;
  int out_ = -1, err_ = -1, in_ = -1;
  bool reaped_ = false;
};

}  // namespace ddp::test
