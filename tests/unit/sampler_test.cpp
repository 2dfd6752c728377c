// ddp/sampler.hpp against torch 2.15's DistributedSampler (tests/data/sampler.json), plus the
// properties ddp adds (exact evaluation view, repeat-epoch warning, batches, shard_indices).

#include <ddp/sampler.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <map>
#include <numeric>
#include <ranges>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_sampler {

namespace {

using nlohmann::json;
using index_list = std::vector<std::int64_t>;

const json& golden() {
  static const json data = [] {
    std::ifstream in(std::string(DDP_TEST_DATA_DIR) + "/sampler.json");
    if (!in.good()) throw std::runtime_error("cannot open " + std::string(DDP_TEST_DATA_DIR) + "/sampler.json");
    return json::parse(in);
  }();
  return data;
}

std::string describe(const json& c) {
  std::ostringstream out;
  out << "n=" << c["n"] << " W=" << c["num_replicas"] << " rank=" << c["rank"] << " shuffle=" << c["shuffle"]
      << " drop_last=" << c["drop_last"] << " seed=" << c["seed"] << " epoch=" << c["epoch"];
  return out.str();
}

// "" when equal, else where the first difference is.
std::string first_mismatch(const index_list& got, const index_list& want) {
  const std::size_t common = std::min(got.size(), want.size());
  for (std::size_t i = 0; i < common; ++i)
    if (got[i] != want[i])
      return "first mismatch at index " + std::to_string(i) + ": got " + std::to_string(got[i]) + ", want " +
             std::to_string(want[i]);
  if (got.size() != want.size())
    return "length " + std::to_string(got.size()) + ", want " + std::to_string(want.size());
  return "";
}

ddp::distributed_sampler make(const json& c, ddp::sampler_options extra = {}) {
  extra.shuffle = c["shuffle"].get<bool>();
  extra.seed = c["seed"].get<std::int64_t>();
  extra.drop_last = c["drop_last"].get<bool>();
  ddp::distributed_sampler s(c["n"].get<std::int64_t>(), c["num_replicas"].get<std::int64_t>(),
                             c["rank"].get<std::int64_t>(), std::move(extra));
  s.set_epoch(c["epoch"].get<std::int64_t>());
  return s;
}

// Every grid case with the given shuffle / drop_last, index for index.
void check_grid(bool shuffle, bool drop_last) {
  std::size_t checked = 0, failed = 0;
  for (const auto& c : golden()["cases"]) {
    if (c["shuffle"].get<bool>() != shuffle || c["drop_last"].get<bool>() != drop_last) continue;
    ++checked;
    const auto s = make(c, {.warn = [](std::string_view) {}});
    const auto want = c["indices"].get<index_list>();
    const index_list got(s.begin(), s.end());
    std::string problem = first_mismatch(got, want);
    if (s.num_samples() != c["num_samples"].get<std::int64_t>())
      problem += " num_samples " + std::to_string(s.num_samples()) + ", want " + c["num_samples"].dump();
    if (s.total_size() != c["total_size"].get<std::int64_t>())
      problem += " total_size " + std::to_string(s.total_size()) + ", want " + c["total_size"].dump();
    if (s.size() != want.size()) problem += " size() " + std::to_string(s.size());
    if (s.indices() != got) problem += " indices() differs from iteration";
    if (!problem.empty() && failed++ < 5) FAIL_CHECK(describe(c) << ": " << problem);
  }
  INFO(checked << " cases checked, " << failed << " failed");
  CHECK(failed == 0);
  CHECK(checked == 1944 / 4);
}

}  // namespace

// ---- torch's golden output -----------------------------------------------------------------

TEST_CASE("golden grid: shuffle=True drop_last=False, every n, W, rank, epoch") { check_grid(true, false); }
TEST_CASE("golden grid: shuffle=True drop_last=True, every n, W, rank, epoch") { check_grid(true, true); }
TEST_CASE("golden grid: shuffle=False drop_last=False, every n, W, rank, epoch") { check_grid(false, false); }
TEST_CASE("golden grid: shuffle=False drop_last=True, every n, W, rank, epoch") { check_grid(false, true); }

TEST_CASE("golden grid: the whole file has 1944 cases") { CHECK(golden()["cases"].size() == 1944); }

TEST_CASE("golden edge cases: accepted constructions give torch's indices") {
  std::size_t accepted = 0;
  for (const auto& c : golden()["edge_cases"]) {
    if (!c.value("accepted", true)) continue;
    ++accepted;
    INFO(describe(c));
    const auto s = make(c);
    const index_list got(s.begin(), s.end());
    CHECK(first_mismatch(got, c["indices"].get<index_list>()) == "");
    CHECK(s.num_samples() == c["num_samples"].get<std::int64_t>());
    CHECK(s.total_size() == c["total_size"].get<std::int64_t>());
  }
  CHECK(accepted == 14);
}

TEST_CASE("golden edge cases: rejected constructions are invalid_argument with torch's message") {
  std::size_t rejected = 0;
  for (const auto& c : golden()["edge_cases"]) {
    if (c.value("accepted", true)) continue;
    ++rejected;
    INFO(describe(c));
    REQUIRE(c["error_type"].get<std::string>() == "ValueError");
    const auto torch_message = c["error"].get<std::string>();
    try {
      (void)make(c);
      FAIL_CHECK("accepted, but torch raises: " << torch_message);
    } catch (const ddp::error& e) {
      CHECK(e.code() == ddp::errc::invalid_argument);
      CHECK(e.message().rfind(torch_message, 0) == 0);  // torch's text first, then ours
      CHECK_THAT(std::string(e.what()), Catch::Contains("distributed_sampler"));
    }
  }
  CHECK(rejected == 18);
}

TEST_CASE("rank 2 of 2 reads exactly like torch plus a hint") {
  try {
    ddp::distributed_sampler s(10, 2, 2);
    FAIL("accepted");
  } catch (const ddp::error& e) {
    CHECK_THAT(e.message(), Catch::StartsWith("Invalid rank 2, rank should be in the interval [0, 1]"));
    CHECK_THAT(e.message(), Catch::Contains("num_replicas = 2"));
  }
}

TEST_CASE("negative dataset size and out-of-range integer types are rejected") {
  CHECK_THROWS_AS(ddp::distributed_sampler(-1, 1, 0), ddp::error);
  CHECK_THROWS_AS(ddp::distributed_sampler(std::uint64_t{1} << 63, 1, 0), ddp::error);
  CHECK_NOTHROW(ddp::distributed_sampler(std::size_t{10}, 2, 1));  // container size() and int ranks
}

TEST_CASE("shard_indices of the epoch's randperm equals the golden shuffled cases") {
  std::size_t failed = 0;
  for (const auto& c : golden()["cases"]) {
    if (!c["shuffle"].get<bool>()) continue;
    ddp::torch_generator gen{c["seed"].get<std::uint64_t>() + c["epoch"].get<std::uint64_t>()};
    const auto order = ddp::randperm(c["n"].get<std::int64_t>(), gen);
    const auto got = ddp::shard_indices(order, c["num_replicas"].get<std::int64_t>(), c["rank"].get<std::int64_t>(),
                                        c["drop_last"].get<bool>());
    const auto problem = first_mismatch(got, c["indices"].get<index_list>());
    if (!problem.empty() && failed++ < 5) FAIL_CHECK(describe(c) << ": " << problem);
  }
  CHECK(failed == 0);
}

// ---- properties ----------------------------------------------------------------------------

TEST_CASE("without drop_last the ranks cover 0..n-1 and only the padding repeats") {
  for (std::int64_t n : {0, 1, 2, 3, 7, 10, 17, 64, 100, 1001})
    for (std::int64_t w : {1, 2, 3, 4, 5, 8, 16, 33}) {
      INFO("n=" << n << " W=" << w);
      std::vector<int> count(static_cast<std::size_t>(n), 0);
      std::int64_t total = 0, padded = 0;
      for (std::int64_t r = 0; r < w; ++r) {
        ddp::distributed_sampler s(n, w, r, {.shuffle = true, .seed = 3});
        s.set_epoch(5);
        for (auto i : s) {
          REQUIRE(i >= 0);
          REQUIRE(i < n);
          ++count[static_cast<std::size_t>(i)];
          ++total;
        }
        padded += s.num_padded();
        CHECK(s.size() == static_cast<std::size_t>((n + w - 1) / w));  // ceil(n / W), closed form
      }
      CHECK(total == (n + w - 1) / w * w);
      CHECK(std::count(count.begin(), count.end(), 0) == 0);
      CHECK(padded == total - n);
      // The repeats are the head of the order; with padding < W each index repeats at most once.
      std::int64_t extra = 0;
      for (int k : count) extra += k - 1;
      CHECK(extra == total - n);
    }
}

TEST_CASE("with drop_last every rank gets floor(n / W) distinct indices") {
  for (std::int64_t n : {0, 1, 5, 17, 100, 1025})
    for (std::int64_t w : {1, 2, 3, 8}) {
      INFO("n=" << n << " W=" << w);
      std::vector<int> count(static_cast<std::size_t>(n), 0);
      for (std::int64_t r = 0; r < w; ++r) {
        ddp::distributed_sampler s(n, w, r, {.shuffle = true, .drop_last = true});
        CHECK(s.size() == static_cast<std::size_t>(n / w));
        CHECK(s.num_padded() == 0);
        for (auto i : s.indices()) ++count[static_cast<std::size_t>(i)];
      }
      CHECK(std::count(count.begin(), count.end(), 1) == n / w * w);
      CHECK(std::count_if(count.begin(), count.end(), [](int k) { return k > 1; }) == 0);
    }
}

TEST_CASE("exact(): the ranks' lists hold every sample exactly once, with and without drop_last") {
  for (bool drop_last : {false, true})
    for (bool shuffle : {true, false})
      for (std::int64_t n : {0, 1, 2, 9, 10, 17, 1023, 1025})
        for (std::int64_t w : {1, 2, 3, 4, 8, 12}) {
          INFO("n=" << n << " W=" << w << " drop_last=" << drop_last << " shuffle=" << shuffle);
          std::vector<int> count(static_cast<std::size_t>(n), 0);
          std::size_t smallest = SIZE_MAX, largest = 0;
          for (std::int64_t r = 0; r < w; ++r) {
            ddp::distributed_sampler s(n, w, r, {.shuffle = shuffle, .drop_last = drop_last});
            s.set_epoch(2);
            const auto& exact = s.exact();
            for (auto i : exact) ++count[static_cast<std::size_t>(i)];
            smallest = std::min(smallest, exact.size());
            largest = std::max(largest, exact.size());
            if (!drop_last) {
              // exact() is indices() without its padded tail.
              REQUIRE(exact.size() + static_cast<std::size_t>(s.num_padded()) == s.size());
              CHECK(std::equal(exact.begin(), exact.end(), s.indices().begin()));
            }
          }
          CHECK(std::count(count.begin(), count.end(), 1) == n);
          CHECK(largest - smallest <= 1);
        }
}

TEST_CASE("exact_batches cover exact() in order") {
  ddp::distributed_sampler s(1025, 4, 3);
  index_list joined;
  for (auto b : s.exact_batches(100)) joined.insert(joined.end(), b.begin(), b.end());
  CHECK(joined == s.exact());
  CHECK(s.exact().size() == 256);  // ranks 0..3 of 1025: 257, 256, 256, 256
  CHECK(s.num_padded() == 1);
}

TEST_CASE("set_epoch changes the shuffled order and keeps it reproducible") {
  ddp::distributed_sampler s(100, 2, 0, {.warn = [](std::string_view) {}});
  s.set_epoch(0);
  const auto e0 = s.indices();
  s.set_epoch(1);
  const auto e1 = s.indices();
  CHECK(e0 != e1);
  CHECK(s.epoch() == 1);
  s.set_epoch(0);
  CHECK(s.indices() == e0);
  ddp::distributed_sampler fixed(100, 2, 0, {.shuffle = false});
  fixed.set_epoch(7);
  index_list want(50);
  for (std::size_t k = 0; k < 50; ++k) want[k] = static_cast<std::int64_t>(2 * k);
  CHECK(fixed.indices() == want);
}

TEST_CASE("the seed option shifts the permutation like seed + epoch") {
  ddp::distributed_sampler a(50, 1, 0, {.seed = 10});
  a.set_epoch(3);
  ddp::distributed_sampler b(50, 1, 0, {.seed = 12});
  b.set_epoch(1);
  CHECK(a.indices() == b.indices());
  ddp::torch_generator gen{13};
  CHECK(a.indices() == ddp::randperm(50, gen));
}

TEST_CASE("iterating a shuffled sampler twice in one epoch warns exactly once") {
  std::vector<std::string> warnings;
  ddp::distributed_sampler s(20, 2, 1, {.warn = [&](std::string_view m) { warnings.emplace_back(m); }});
  s.set_epoch(4);
  for (auto i : s) (void)i;
  (void)s.indices();  // reading the list is not a pass
  (void)s.exact();
  CHECK(warnings.empty());
  for (auto i : s) (void)i;
  REQUIRE(warnings.size() == 1);
  CHECK(warnings[0] ==
        "ddp: distributed_sampler iterated again for epoch 4 without set_epoch(): the order repeats; call "
        "set_epoch(epoch) at the start of every epoch");
  for (auto b : s.batches(3)) (void)b;
  for (auto i : s) (void)i;
  CHECK(warnings.size() == 1);  // once per sampler
}

TEST_CASE("the repeat warning: not after set_epoch, not without shuffle, counts batches() as a pass") {
  std::vector<std::string> warnings;
  auto sink = [&](std::string_view m) { warnings.emplace_back(m); };
  ddp::distributed_sampler s(20, 2, 0, {.warn = sink});
  for (int epoch = 0; epoch < 4; ++epoch) {
    s.set_epoch(epoch);
    for (auto b : s.batches(4)) (void)b;
  }
  CHECK(warnings.empty());
  (void)s.batches(4);
  CHECK(warnings.size() == 1);

  std::vector<std::string> none;
  ddp::distributed_sampler fixed(20, 2, 0, {.shuffle = false, .warn = [&](std::string_view m) { none.emplace_back(m); }});
  for (int k = 0; k < 3; ++k)
    for (auto i : fixed) (void)i;
  CHECK(none.empty());
}

TEST_CASE("the repeat warning goes to std::cerr by default") {
  std::ostringstream captured;
  auto* old = std::cerr.rdbuf(captured.rdbuf());
  {
    ddp::distributed_sampler s(8, 1, 0);
    for (auto i : s) (void)i;
    for (auto i : s) (void)i;
  }
  std::cerr.rdbuf(old);
  CHECK_THAT(captured.str(), Catch::StartsWith("ddp: distributed_sampler iterated again for epoch 0"));
}

// ---- batches -------------------------------------------------------------------------------

static_assert(std::ranges::forward_range<ddp::index_batches>);
static_assert(std::ranges::forward_range<const ddp::distributed_sampler>);

TEST_CASE("batches: consecutive chunks, the last partial one kept unless drop_last_batch") {
  ddp::distributed_sampler s(1000, 3, 2, {.warn = [](std::string_view) {}});  // 334 indices
  REQUIRE(s.size() == 334);
  const auto& all = s.indices();
  const auto batches = s.batches(32);
  CHECK(batches.size() == 11);  // ceil(334 / 32)
  std::size_t offset = 0, count = 0;
  for (auto b : batches) {
    CHECK(b.size() == std::min<std::size_t>(32, 334 - offset));
    CHECK(std::equal(b.begin(), b.end(), all.begin() + static_cast<std::ptrdiff_t>(offset)));
    offset += b.size();
    ++count;
  }
  CHECK(offset == 334);
  CHECK(count == 11);
  CHECK(batches[10].size() == 14);

  std::size_t full = 0;
  for (auto b : s.batches(32, true)) {
    CHECK(b.size() == 32);
    ++full;
  }
  CHECK(full == 10);
  CHECK(s.batches(1000).size() == 1);
  CHECK(s.batches(1000, true).empty());
}

TEST_CASE("batches: the tutorial's 32 steps per epoch for W=1 and 16 for W=2 (training.json)") {
  std::ifstream in(std::string(DDP_TEST_DATA_DIR) + "/training.json");
  REQUIRE(in.good());
  const auto training = json::parse(in);
  for (const char* key : {"W1_simulated", "W2_simulated"}) {
    const auto& run = training[key];
    const std::int64_t w = key[1] - '0';
    ddp::distributed_sampler s(1024, w, 0, {.shuffle = true, .seed = 0});
    CHECK(s.num_samples() == run["num_samples_per_rank"].get<std::int64_t>());
    CHECK(s.batches(32).size() == run["steps_per_epoch"].get<std::size_t>());
  }
}

TEST_CASE("batches: batch_size < 1 is invalid_argument with torch's wording") {
  ddp::distributed_sampler s(10, 1, 0);
  for (std::int64_t bad : {0, -3}) {
    try {
      (void)s.batches(bad);
      FAIL("accepted batch_size " << bad);
    } catch (const ddp::error& e) {
      CHECK(e.code() == ddp::errc::invalid_argument);
      CHECK(e.message() == "batch_size should be a positive integer value, but got batch_size=" + std::to_string(bad));
    }
  }
  const index_list some{1, 2, 3};
  CHECK_THROWS_AS(ddp::batches(some, 0), ddp::error);
}

TEST_CASE("batches stay valid after set_epoch moves the sampler on") {
  ddp::distributed_sampler s(64, 1, 0);
  const auto epoch0 = s.indices();
  const auto held = s.batches(10);
  s.set_epoch(1);
  (void)s.indices();  // recomputes for epoch 1
  index_list joined;
  for (auto b : held) joined.insert(joined.end(), b.begin(), b.end());
  CHECK(joined == epoch0);
  CHECK(s.indices() != epoch0);
}

TEST_CASE("ddp::batches over any index list") {
  const index_list list{5, 4, 3, 2, 1, 0, 9};
  std::vector<std::size_t> sizes;
  for (auto b : ddp::batches(list, 3)) sizes.push_back(b.size());
  CHECK(sizes == std::vector<std::size_t>{3, 3, 1});
  CHECK(ddp::batches(index_list{}, 4).size() == 0);
}

// ---- shard_indices -------------------------------------------------------------------------

TEST_CASE("shard_indices: torch's padding and striding over an arbitrary base sequence") {
  const index_list base{40, 41, 42, 43, 44};  // e.g. a weighted sampler's draw
  CHECK(ddp::shard_indices(base, 2, 0) == index_list{40, 42, 44});
  CHECK(ddp::shard_indices(base, 2, 1) == index_list{41, 43, 40});  // padded from the head
  CHECK(ddp::shard_indices(base, 2, 1, true) == index_list{41, 43});
  CHECK(ddp::shard_indices(base, 8, 7) == index_list{42});  // padding longer than n: repeat the list
  CHECK(ddp::shard_indices(base, 8, 7, true).empty());
  CHECK(ddp::shard_indices_exact(base, 2, 1) == index_list{41, 43});
  CHECK(ddp::shard_indices_exact(base, 8, 7).empty());
  const index_list single{9};
  CHECK(ddp::shard_indices(single, 8, 3) == index_list{9});
  CHECK(ddp::shard_indices(index_list{}, 3, 2).empty());
  CHECK_THROWS_AS(ddp::shard_indices(base, 2, 2), ddp::error);
  CHECK_THROWS_AS(ddp::shard_indices_exact(base, 0, 0), ddp::error);
}

TEST_CASE("shard_indices of 0..n-1 equals the unshuffled sampler for every W and rank") {
  for (std::int64_t n : {1, 5, 10, 17, 100})
    for (std::int64_t w : {1, 2, 3, 8})
      for (std::int64_t r = 0; r < w; ++r)
        for (bool drop_last : {false, true}) {
          index_list base(static_cast<std::size_t>(n));
          std::iota(base.begin(), base.end(), 0);
          ddp::distributed_sampler s(n, w, r, {.shuffle = false, .drop_last = drop_last});
          CHECK(ddp::shard_indices(base, w, r, drop_last) == s.indices());
        }
}

}  // namespace ddp_test_sampler
