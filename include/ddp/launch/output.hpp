#pragma once
// The launcher's output: its own lines (log_line), and each worker's stdout / stderr copied to
// the launcher's through a pipe (output_pipe), prefixed or not, keeping stderr's last line.

#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <string>
#include <string_view>

#include "ddp/core/unique_fd.hpp"
#include "ddp/launch/options.hpp"

namespace ddp::detail {

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

}  // namespace ddp::detail
