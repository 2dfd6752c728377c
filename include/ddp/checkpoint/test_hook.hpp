#pragma once
// The checkpoint test hook, DDP_CHECKPOINT_TEST_HOOK (documented in ddp/checkpoint.hpp): save()
// marks its points with test_point(), where the chosen rank kills itself or pauses.

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include "ddp/checkpoint/preemption.hpp"
#include "ddp/core/compiled.hpp"
#include "ddp/core/env_registry.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <system_error>
#include <vector>
#endif

namespace ddp::checkpoint::detail {

// The step save() is writing, for the hook; per thread: tests run ranks as threads.
inline thread_local std::int64_t saving_step = -1;
inline thread_local int saving_rank = -1;

/// The test hook: at `point` of saving its step, the rank kills itself (SIGKILL) or stops until a
/// test kills it. With FILE, only the first rank that creates FILE acts (once per job, also
/// across restarts); FILE tells the test that the rank is there.
void test_point(std::string_view point);

void before_rename(const std::filesystem::path&);

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
struct test_hook {
  std::string action;  // kill | pause
  std::int64_t step = -1;
  int rank = -1;
  std::string point;  // tmp | done | after
  std::string once_file;
};

DDP_COMPILED_INLINE const test_hook& hook() {
  static const test_hook h = [] {
    test_hook out;
    const char* v = read_env("DDP_CHECKPOINT_TEST_HOOK");
    if (v == nullptr) return out;
    std::vector<std::string> parts(1);
    for (const char* c = v; *c != '\0'; ++c) {
      if (*c == ':' && parts.size() < 5)
        parts.emplace_back();
      else
        parts.back() += *c;
    }
    if (parts.size() < 4 || (parts[0] != "kill" && parts[0] != "pause")) {
      std::cerr << "ddp: DDP_CHECKPOINT_TEST_HOOK=" << v << " ignored (expected kill|pause:STEP:RANK:tmp|done|after[:FILE])\n";
      return out;
    }
    out = {.action = parts[0], .step = std::strtoll(parts[1].c_str(), nullptr, 10),
           .rank = static_cast<int>(std::strtol(parts[2].c_str(), nullptr, 10)), .point = parts[3],
           .once_file = parts.size() > 4 ? parts[4] : std::string()};
    return out;
  }();
  return h;
}

DDP_COMPILED_INLINE void test_point(std::string_view point) {
  const auto& h = hook();
  if (h.step != saving_step || h.rank != saving_rank || h.point != point) return;
  if (!h.once_file.empty()) {
    const int fd = ::open(h.once_file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return;
    ::close(fd);
  }
  if (h.action == "kill") ::raise(SIGKILL);
  // Paused until FILE.go exists, a preemption signal arrives (a scheduler's signal reaches every
  // rank, this one too: the test learns of no delivery it could wait for) or killed. The
  // launcher's SIGTERM, when a test kills another rank, must still end it, so SIGTERM and SIGINT
  // take their default action meanwhile.
  struct sigaction dfl {}, old_term {}, old_int {};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(SIGTERM, &dfl, &old_term);
  ::sigaction(SIGINT, &dfl, &old_int);
  const std::string go = h.once_file + ".go";
  for (std::error_code ec; !std::filesystem::exists(go, ec) && ddp::detail::preemption_signal.load() == 0;) ::usleep(1000);
  ::sigaction(SIGTERM, &old_term, nullptr);
  ::sigaction(SIGINT, &old_int, nullptr);
}

DDP_COMPILED_INLINE void before_rename(const std::filesystem::path&) { test_point("tmp"); }
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp::checkpoint::detail
