#pragma once
// Naming a failed job's root cause: which worker error lines report another rank's failure, the
// departure text the store passes on, and the summary printed once every worker has ended.

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/core/deadline.hpp"
#include "ddp/launch/options.hpp"
#include "ddp/launch/output.hpp"
#include "ddp/launch/result.hpp"

namespace ddp::detail {

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

/// After every worker has ended: takes each worker's last stderr line, picks the root cause
/// among the workers that failed on their own (see ddp/launch/job.hpp) and prints the summary.
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

}  // namespace ddp::detail
