#pragma once
// Runs a test body once per rank on threads of this process, for groups whose ranks are threads
// (a hash_store between them). Catch's assertion macros are not thread-safe: bodies check with
// exceptions (ddp::test::check), and run_threads rethrows the first one here, after every
// thread has joined, where the test's macros can see it.

#include <cstddef>
#include <exception>
#include <thread>
#include <vector>

namespace ddp::test {

/// fn(rank) on n threads; rethrows the exception of the lowest rank that threw, once all joined.
template <class F>
void run_threads(int n, F fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace ddp::test
