#pragma once
// What spawn() and launch() report: how each worker ended (worker_status) and how the job did
// (launch_result: exit code, root cause, restarts, where its store was).

#include <sys/types.h>

#include <string>
#include <vector>

#include "ddp/core/compiled.hpp"
#if !DDP_DECLARATIONS_ONLY
#include "ddp/launch/process.hpp"
#endif

namespace ddp {

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
  int failed = -1;   // local rank of the root cause (see ddp/launch/job.hpp); -1 when none failed on its own
  int signal = 0;    // the signal that stopped the launcher; 0 when none
  int restarts = 0;  // restarts launch() made
  std::string master_addr;
  int master_port = 0;
  bool ok() const noexcept { return exit_code == 0; }
};

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
DDP_COMPILED_INLINE std::string worker_status::describe() const {
  std::string s = "rank " + std::to_string(rank) + " (local " + std::to_string(local_rank) + ", pid " + std::to_string(pid) + ")";
  if (signal != 0) s += " was killed by signal " + detail::describe_signal(signal);
  else s += " exited with code " + std::to_string(exit_code);
  return s;
}
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp
