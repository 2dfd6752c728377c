#pragma once
// A test that cannot run here says so: it prints "SKIPPED: <reason>" and exits with 77,
// which ctest (SKIP_RETURN_CODE 77 on every ddp test) reports as skipped, not passed.
#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace ddp::test {

[[noreturn]] inline void skip(std::string_view reason) {
  std::printf("SKIPPED: %.*s\n", static_cast<int>(reason.size()), reason.data());
  std::fflush(nullptr);
  std::_Exit(77);
}

}  // namespace ddp::test
