#pragma once
// Collects a store server's log lines (written by its thread, read by the test).

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "ddp/store/tcp_store.hpp"

namespace ddp::test {

struct log_capture {
  std::mutex mutex;
  std::vector<std::string> lines;
  ddp::store::store_log_fn sink() {
    return [this](const std::string& line) {
      std::lock_guard g(mutex);
      lines.push_back(line);
    };
  }
  bool contains(const std::string& text) {
    std::lock_guard g(mutex);
    return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return l.find(text) != std::string::npos; });
  }
  /// Every line, each followed by a newline.
  std::string all() {
    std::lock_guard g(mutex);
    std::string s;
    for (const auto& l : lines) s += l + "\n";
    return s;
  }
};

}  // namespace ddp::test
