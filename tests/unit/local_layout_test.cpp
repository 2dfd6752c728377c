// Local rank and local world size derived at rendezvous, for launchers that give only RANK and
// WORLD_SIZE (Kubeflow's PyTorchJob): one rank per thread over one hash_store, each posing as a
// host through its identity. The expected layouts are written out by hand.
#include <catch2/catch.hpp>

#include <string>
#include <thread>
#include <vector>

#include <ddp/ddp.hpp>

namespace local_layout_test {

struct layout {
  int local_rank, local_world_size, node_rank, num_nodes;
  bool operator==(const layout&) const = default;
};

// Catch's assertions are not thread-safe: the ranks record, the test thread checks.
struct rank_result {
  layout values{};
  bool flag_cleared = false;
  std::string origin;
};

std::vector<layout> derive(const std::vector<std::string>& hosts) {
  ddp::store::hash_store st;
  const int world = static_cast<int>(hosts.size());
  std::vector<rank_result> results(hosts.size());
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      ddp::launch_environment env;
      env.rank = r;
      env.world_size = world;
      env.local_layout_from_rendezvous = true;
      ddp::detail::pg_derive_local_layout(env, st, "test/0", r, world, hosts[static_cast<std::size_t>(r)]);
      auto& mine = results[static_cast<std::size_t>(r)];
      mine.values = {env.local_rank, env.local_world_size, env.node_rank, env.num_nodes};
      mine.flag_cleared = !env.local_layout_from_rendezvous;
      mine.origin = env.origin.local_rank;
    });
  }
  for (auto& t : ranks) t.join();
  std::vector<layout> out;
  for (const auto& result : results) {
    CHECK(result.flag_cleared);
    CHECK(result.origin == "derived at rendezvous (ranks sharing a host)");
    out.push_back(result.values);
  }
  return out;
}

TEST_CASE("PyTorchJob without LOCAL_RANK: one host, four ranks") {
  CHECK(derive({"a", "a", "a", "a"}) == std::vector<layout>{{0, 4, 0, 1}, {1, 4, 0, 1}, {2, 4, 0, 1}, {3, 4, 0, 1}});
}

TEST_CASE("PyTorchJob without LOCAL_RANK: one pod per rank (a one-GPU pod with RANK=1 gets local rank 0)") {
  CHECK(derive({"pod-0", "pod-1"}) == std::vector<layout>{{0, 1, 0, 2}, {0, 1, 1, 2}});
}

TEST_CASE("PyTorchJob without LOCAL_RANK: two hosts, ranks interleaved across them") {
  CHECK(derive({"a", "b", "a", "b", "b"}) ==
        std::vector<layout>{{0, 2, 0, 2}, {0, 3, 1, 2}, {1, 2, 0, 2}, {1, 3, 1, 2}, {2, 3, 1, 2}});
}

}  // namespace local_layout_test
