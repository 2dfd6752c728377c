#pragma once
// What a test checks was left behind: entries in /dev/shm and this process's open descriptors.

#include <dirent.h>

#include <string>
#include <vector>

namespace ddp::test {

/// The names in /dev/shm that contain `needle` (a test's store prefix or job tag).
inline std::vector<std::string> shm_entries(const std::string& needle) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d))
      if (std::string(e->d_name).find(needle) != std::string::npos) out.push_back(e->d_name);
    ::closedir(d);
  }
  return out;
}

/// The entries of /proc/self/fd (this process's descriptors, plus the one reading them and the
/// directory's own two), to compare before and after; -1 without /proc.
inline int open_fds() {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  int n = 0;
  while (::readdir(d) != nullptr) ++n;
  ::closedir(d);
  return n;
}

}  // namespace ddp::test
