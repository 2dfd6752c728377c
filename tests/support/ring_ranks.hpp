#pragma once
// Forked ranks over a real ring backend, meeting through a file store: the harness of the
// data-parallel multiprocess tests (ZeRO, mixed precision, the distributed optimizer helpers).

#include <catch2/catch.hpp>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp/backends/ring.hpp"
#include "ddp/group.hpp"
#include "ddp/process_group.hpp"
#include "ddp/store/file_store.hpp"
#include "support/multiprocess.hpp"

namespace ddp::test {

using ring_group = ddp::process_group<ddp::ring_backend>;
using ring_transport = ddp::ring_options::transport_kind;

/// A file store's path under the test binary directory, removed before and after use.
struct ring_store_file {
  explicit ring_store_file(const std::string& name)
      : path(std::string(DDP_TEST_BINARY_DIR) + "/" + name + "_" + std::to_string(::getpid()) + ".store") {
    std::remove(path.c_str());
  }
  ~ring_store_file() { std::remove(path.c_str()); }
  ring_store_file(const ring_store_file&) = delete;
  ring_store_file& operator=(const ring_store_file&) = delete;
  std::string path;
};

inline ring_group make_ring_group(const std::string& path, int rank, int p, ring_transport transport) {
  using namespace std::chrono_literals;
  auto store = std::make_shared<ddp::store::file_store>(path);
  ddp::ring_options o;
  o.transport = transport;
  o.timeout = 60s;
  return ring_group(ddp::ring_backend(store, rank, p, o), {.timeout = 60s});
}

/// Nobody exits before every rank's last collective is done.
inline void leave_together(const std::string& path, int rank, int p) {
  using namespace std::chrono_literals;
  ddp::store::file_store store(path);
  store.set_string("left/" + std::to_string(rank), "1");
  std::vector<std::string> keys;
  for (int r = 0; r < p; ++r) keys.push_back("left/" + std::to_string(r));
  store.wait(keys, 60s);
}

inline const char* name_of(ring_transport t) { return t == ring_transport::shm ? "shm" : "tcp"; }

/// Runs fn(rank, group) on p forked ranks over `transport` (through ddp::group when type_erased),
/// prints what the ranks printed, and fails the test case unless every rank passed. The store
/// file is named prefix_name_<transport><p>.
template <class Fn>
void on_ring_ranks(const std::string& prefix, int p, ring_transport transport, const std::string& name, Fn fn,
                   bool type_erased = false) {
  using namespace std::chrono_literals;
  ring_store_file sf(prefix + "_" + name + "_" + name_of(transport) + std::to_string(p));
  const auto result = run_ranks(
      p,
      [&](int rank) {
        auto group = make_ring_group(sf.path, rank, p, transport);
        check(group.backend().on_shared_memory() == (transport == ring_transport::shm), "transport chosen as asked");
        if (type_erased) {
          if constexpr (std::is_invocable_v<Fn&, int, ddp::group&>) {
            ddp::group erased(std::move(group));
            fn(rank, erased);
          } else {
            throw std::logic_error("on_ring_ranks: type_erased needs a function that takes ddp::group&");
          }
        } else {
          fn(rank, group);
        }
        leave_together(sf.path, rank, p);
      },
      300s);
  for (const auto& r : result.ranks)
    if (!r.output.empty()) std::printf("%s %s W=%d rank %d:\n%s", name.c_str(), name_of(transport), p, r.rank, r.output.c_str());
  INFO(name << " over " << name_of(transport) << " with W = " << p << "\n" << result.describe());
  CHECK(result.ok());
}

}  // namespace ddp::test
