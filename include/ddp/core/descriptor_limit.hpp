#pragma once
// Enough file descriptors for a job, checked before rendezvous: the store's host holds one
// connection per rank, and every rank a socket per tcp peer and a pidfd per shared-memory peer.
// Run out halfway and accept()/socket() fail with EMFILE long after the cause, on some ranks
// only; checked first, the job either raises its soft limit or stops at once with one line.

#include <cstddef>
#include <string>
#include <string_view>

#include "ddp/core/compiled.hpp"
#include "ddp/core/error.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <dirent.h>
#include <sys/resource.h>
#endif

namespace ddp {

/// Descriptors this process has open now.
std::size_t open_descriptors() noexcept;

/// Makes sure this process may open `needed` more descriptors (for `what`, e.g. "a rendezvous of
/// 64 ranks"): raises the soft RLIMIT_NOFILE toward the hard one when that is enough, as Go's
/// runtime does at start, else throws errc::config naming the limit, the need and the fix.
void ensure_descriptors(std::size_t needed, std::string_view what, int rank = -1);

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
DDP_COMPILED_INLINE std::size_t open_descriptors() noexcept {
  std::size_t n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') ++n;
    ::closedir(d);
    return n > 0 ? n - 1 : 0;  // less the one opendir holds
  }
  return 0;
}

DDP_COMPILED_INLINE void ensure_descriptors(std::size_t needed, std::string_view what, int rank) {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  const std::size_t want = open_descriptors() + needed;
  if (lim.rlim_cur == RLIM_INFINITY || lim.rlim_cur >= want) return;
  if (lim.rlim_max == RLIM_INFINITY || lim.rlim_max >= want) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max == RLIM_INFINITY ? static_cast<rlim_t>(want) : lim.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) return;
  }
  throw error(errc::config,
              std::string(what) + " needs about " + std::to_string(want) + " open files in this process, and its limit is " +
                  std::to_string(static_cast<unsigned long long>(lim.rlim_cur)) + " (hard limit " +
                  (lim.rlim_max == RLIM_INFINITY ? std::string("unlimited") : std::to_string(static_cast<unsigned long long>(lim.rlim_max))) +
                  "): raise it with `ulimit -n " + std::to_string(want) + "` (or LimitNOFILE / the scheduler's limit) before starting the job",
              {.rank = rank});
}
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp
