// ddp/random.hpp against real PyTorch 2.15 output (tests/data/*.json, see tests/data/README.md).
// Floats are compared bit for bit through their little-endian hex, as the golden files store them.

#include <ddp/random.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_random {

namespace {

using nlohmann::json;

const json& load(const std::string& name) {
  static std::map<std::string, json> cache;
  auto it = cache.find(name);
  if (it == cache.end()) {
    std::ifstream in(std::string(DDP_TEST_DATA_DIR) + "/" + name);
    REQUIRE(in.good());
    it = cache.emplace(name, json::parse(in)).first;
  }
  return it->second;
}

// struct.pack('<f', x).hex(): the four bytes in memory order.
std::string hex_of(float v) {
  const auto bits = std::bit_cast<std::uint32_t>(v);
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (int byte = 0; byte < 4; ++byte) {
    const unsigned b = (bits >> (8 * byte)) & 0xffU;
    out += digits[b >> 4];
    out += digits[b & 0xfU];
  }
  return out;
}

std::vector<std::string> hex_of(const std::vector<float>& v) {
  std::vector<std::string> out;
  for (float x : v) out.push_back(hex_of(x));
  return out;
}

// Compares element by element and reports the first mismatch and the mismatch count.
template <class T>
void check_same(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  INFO(what);
  REQUIRE(got.size() == want.size());
  std::size_t mismatches = 0, first = got.size();
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!(got[i] == want[i])) {
      if (mismatches++ == 0) first = i;
    }
  if (mismatches != 0) {
    std::ostringstream msg;
    msg << what << ": " << mismatches << " of " << got.size() << " differ; first at index " << first << ": got "
        << got[first] << ", want " << want[first];
    FAIL(msg.str());
  }
  SUCCEED();
}

// How many words `gen` has consumed since seeding with `seed`, checked by replaying words.
bool consumed_exactly(const ddp::torch_generator& gen, std::uint64_t seed, std::uint64_t words) {
  ddp::torch_generator ref{seed};
  ref.discard(words);
  return ref.state().mt == gen.state().mt && ref.state().next == gen.state().next &&
         ref.state().left == gen.state().left;
}

}  // namespace

// ---- the engine ----------------------------------------------------------------------------

TEST_CASE("torch_generator: state right after manual_seed equals torch's get_state()") {
  for (const auto& entry : load("sampler.json")["raw_generator_stream"]) {
    const auto seed = entry["seed"].get<std::uint64_t>();
    INFO("seed " << seed);
    const ddp::torch_generator gen{seed};
    CHECK(gen.initial_seed() == entry["initial_seed"].get<std::uint64_t>());
    const auto& words = entry["get_state_first_words"];
    CHECK(gen.state().left == words["left"].get<int>());
    CHECK(gen.state().next == words["next"].get<int>());
    for (std::size_t i = 0; i < 4; ++i) CHECK(gen.state().mt[i] == words["state0_3"][i].get<std::uint32_t>());
    CHECK_FALSE(gen.next_double_normal_sample().has_value());
  }
}

TEST_CASE("torch_generator: first 16 words per seed equal torch's random_(-2**63, None) read-out") {
  for (const auto& entry : load("sampler.json")["raw_generator_stream"]) {
    const auto seed = entry["seed"].get<std::uint64_t>();
    ddp::torch_generator gen{seed};
    std::vector<std::uint32_t> got;
    for (int i = 0; i < 16; ++i) got.push_back(gen.random());
    check_same(got, entry["mt19937_first16_uint32"].get<std::vector<std::uint32_t>>(), "seed " + std::to_string(seed));
  }
}

TEST_CASE("torch_generator: random64 is (first word << 32) | second word") {
  const auto& entry = load("sampler.json")["raw_generator_stream"][0];
  const auto words = entry["mt19937_first16_uint32"].get<std::vector<std::uint64_t>>();
  ddp::torch_generator gen{entry["seed"].get<std::uint64_t>()};
  for (std::size_t i = 0; i < 8; ++i) CHECK(gen.random64() == ((words[2 * i] << 32) | words[2 * i + 1]));
}

TEST_CASE("torch_generator: the stream is std::mt19937 seeded with seed mod 2^32, across many twists") {
  for (const std::uint64_t seed : {0ULL, 1ULL, 42ULL, (1ULL << 40) + 7, 0xffffffffffffffffULL}) {
    INFO("seed " << seed);
    ddp::torch_generator gen{seed};
    std::mt19937 ref(static_cast<std::uint32_t>(seed));
    std::uint64_t mismatches = 0;
    for (int i = 0; i < 5000; ++i) mismatches += gen.random() != ref();
    CHECK(mismatches == 0);
  }
}

TEST_CASE("torch_generator: seed 2**40+7 gives the same stream as seed 7, but keeps its full initial_seed") {
  const auto& streams = load("sampler.json")["raw_generator_stream"];
  json seven, big;
  for (const auto& e : streams) {
    if (e["seed"].get<std::uint64_t>() == 7) seven = e;
    if (e["seed"].get<std::uint64_t>() == (1ULL << 40) + 7) big = e;
  }
  REQUIRE(!seven.is_null());
  REQUIRE(!big.is_null());
  CHECK(seven["mt19937_first16_uint32"] == big["mt19937_first16_uint32"]);
  ddp::torch_generator a{7}, b{(1ULL << 40) + 7};
  for (int i = 0; i < 100; ++i) REQUIRE(a.random() == b.random());
  CHECK(b.initial_seed() == (1ULL << 40) + 7);
}

TEST_CASE("torch_generator: manual_seed clears the cached normal and state() round-trips it") {
  ddp::torch_generator gen{0};
  (void)ddp::randn(1, gen);
  REQUIRE(gen.next_double_normal_sample().has_value());
  const auto saved = gen.state();
  const auto a = ddp::randn(3, gen);
  gen.set_state(saved);
  CHECK(ddp::randn(3, gen) == a);
  gen.manual_seed(0);
  CHECK_FALSE(gen.next_double_normal_sample().has_value());
  CHECK(gen == ddp::torch_generator{0});
}

TEST_CASE("torch_generator: default construction uses torch's default seed 67280421310721") {
  CHECK(ddp::torch_generator{}.initial_seed() == 67280421310721ULL);
  CHECK(ddp::torch_generator{} == ddp::torch_generator{67280421310721ULL});
}

// ---- integer draws -------------------------------------------------------------------------

TEST_CASE("random_int32 equals torch int32 random_() (w % 2^31)") {
  for (const auto& entry : load("sampler.json")["raw_generator_stream"]) {
    ddp::torch_generator gen{entry["seed"].get<std::uint64_t>()};
    check_same(ddp::random_int32(16, gen), entry["int32_random_"].get<std::vector<std::int32_t>>(),
               "seed " + entry["seed"].dump() + ": " + entry["int32_random__call"].get<std::string>());
  }
}

TEST_CASE("randint(0, 10) equals torch (one word each)") {
  for (const auto& entry : load("sampler.json")["raw_generator_stream"]) {
    const auto seed = entry["seed"].get<std::uint64_t>();
    ddp::torch_generator gen{seed};
    check_same(ddp::randint(0, 10, 16, gen), entry["randint_0_10"].get<std::vector<std::int64_t>>(),
               "seed " + std::to_string(seed) + ": " + entry["randint_0_10_call"].get<std::string>());
    CHECK(consumed_exactly(gen, seed, 16));
  }
}

TEST_CASE("randint(0, 2**31) equals torch (two words each: range >= 2^28)") {
  for (const auto& entry : load("sampler.json")["raw_generator_stream"]) {
    const auto seed = entry["seed"].get<std::uint64_t>();
    ddp::torch_generator gen{seed};
    check_same(ddp::randint(0, std::int64_t{1} << 31, 16, gen), entry["randint_0_2pow31"].get<std::vector<std::int64_t>>(),
               "seed " + std::to_string(seed) + ": " + entry["randint_0_2pow31_call"].get<std::string>());
    CHECK(consumed_exactly(gen, seed, 32));
  }
}

TEST_CASE("randint rejects an empty range and a negative count") {
  ddp::torch_generator gen{0};
  CHECK_THROWS_AS(ddp::randint(2, 2, 1, gen), ddp::error);
  CHECK_THROWS_AS(ddp::randint(0, 2, -1, gen), ddp::error);
  try {
    (void)ddp::randint(5, 1, 1, gen);
    FAIL("no error");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::invalid_argument);
    CHECK_THAT(e.message(), Catch::Contains("from=5 >= to=1"));
  }
}

TEST_CASE("random_int64 is random64() % 2^63") {
  const auto& entry = load("sampler.json")["raw_generator_stream"][1];
  const auto w = entry["mt19937_first16_uint32"].get<std::vector<std::uint64_t>>();
  ddp::torch_generator gen{entry["seed"].get<std::uint64_t>()};
  const auto got = ddp::random_int64(8, gen);
  for (std::size_t i = 0; i < 8; ++i)
    CHECK(static_cast<std::uint64_t>(got[i]) == (((w[2 * i] << 32) | w[2 * i + 1]) & ~(1ULL << 63)));
}

// ---- uniform -------------------------------------------------------------------------------

TEST_CASE("rand float32 equals torch.rand bit for bit") {
  for (const auto& entry : load("sampler.json")["raw_generator_stream"]) {
    ddp::torch_generator gen{entry["seed"].get<std::uint64_t>()};
    check_same(hex_of(ddp::rand(16, gen)), entry["rand_float32_16_hex"].get<std::vector<std::string>>(),
               "seed " + entry["seed"].dump() + ": " + entry["rand_float32_16_call"].get<std::string>());
  }
}

TEST_CASE("rand_float64 equals torch.rand(dtype=float64) exactly") {
  for (const auto& entry : load("sampler.json")["raw_generator_stream"]) {
    ddp::torch_generator gen{entry["seed"].get<std::uint64_t>()};
    check_same(ddp::rand_float64(8, gen), entry["rand_float64_8"].get<std::vector<double>>(),
               "seed " + entry["seed"].dump() + ": " + entry["rand_float64_8_call"].get<std::string>());
  }
}

TEST_CASE("rand(20) after manual_seed(0) equals data.json rand20_seed0") {
  const auto& want = load("data.json")["rand20_seed0"];
  ddp::torch_generator gen{0};
  check_same(hex_of(ddp::rand(20, gen)), want["hex"].get<std::vector<std::string>>(), want["call"].get<std::string>());
}

TEST_CASE("uniform_ clamps a value that rounds up to `to` back to `from` (torch, seed 1, element 44131175)") {
  // Checked live against torch 2.15: torch.rand(N, generator=seed 1)[44131175] == 1 - 2**-24, and
  // torch.empty(N).uniform_(1, 2, generator=seed 1)[44131175] == 1.0.
  ddp::torch_generator gen{1};
  gen.discard(44131175);
  auto copy = gen;
  CHECK(ddp::rand(1, gen)[0] == 1.0f - 0x1p-24f);
  CHECK(ddp::uniform(1, 1.0, 2.0, copy)[0] == 1.0f);
}

// ---- normal --------------------------------------------------------------------------------

TEST_CASE("randn(1024*10) seeded 42 equals data.json features bit for bit (AVX2/AVX512 kernel)") {
  const auto& want = load("data.json")["features"];
  ddp::torch_generator gen{42};
  check_same(hex_of(ddp::randn(1024 * 10, gen)), want["hex"].get<std::vector<std::string>>(),
             want["call"].get<std::string>());
  CHECK(consumed_exactly(gen, 42, 10240));  // n % 16 == 0: no redrawn tail
}

TEST_CASE("randint(0, 2, 1024) right after the features equals data.json labels") {
  const auto& data = load("data.json");
  ddp::torch_generator gen{42};
  (void)ddp::randn(1024 * 10, gen);
  check_same(ddp::randint(0, 2, 1024, gen), data["labels"]["values"].get<std::vector<std::int64_t>>(),
             data["labels"]["call"].get<std::string>());
}

TEST_CASE("randn(k) seeded 0 equals data.json randn_seed0 for k below and above 16") {
  for (const auto& [key, want] : load("data.json")["randn_seed0"].items()) {
    const std::int64_t k = std::stoll(key);
    ddp::torch_generator gen{0};
    check_same(hex_of(ddp::randn(k, gen)), want["hex"].get<std::vector<std::string>>(),
               want["call"].get<std::string>());
    // Words used: 4 per pair below 16 (double path); k, plus 16 when k % 16 != 0, from 16 on.
    const std::uint64_t words = k < 16 ? 4 * static_cast<std::uint64_t>((k + 1) / 2)
                                       : static_cast<std::uint64_t>(k) + (k % 16 != 0 ? 16 : 0);
    CHECK(consumed_exactly(gen, 0, words));
    CHECK(gen.next_double_normal_sample().has_value() == (k < 16 && k % 2 == 1));
  }
}

TEST_CASE("randn(1) three times on one generator uses the cached Box-Muller sample") {
  const auto& want = load("data.json")["randn1_x3_same_generator"];
  ddp::torch_generator gen{0};
  std::vector<float> got;
  for (int i = 0; i < 3; ++i) got.push_back(ddp::randn(1, gen)[0]);
  check_same(hex_of(got), want["hex"].get<std::vector<std::string>>(), want["call"].get<std::string>());
  ddp::torch_generator again{0};
  CHECK(ddp::randn(3, again) == got);
}

TEST_CASE("torch_cpu_kernel::scalar reproduces torch's DEFAULT kernel (data.json variants)") {
  const auto& variant = load("data.json")["variants_by_cpu_capability"]["default"];
  const auto& features = variant["features_hex"];
  ddp::torch_generator gen{42};
  check_same(hex_of(ddp::randn(1024 * 10, gen, ddp::torch_cpu_kernel::scalar)), features.get<std::vector<std::string>>(),
             "features, ATEN_CPU_CAPABILITY=default");
  const auto& small = variant["randn_seed0_hex"];
  for (const auto& [key, want] : small.items()) {
    ddp::torch_generator g{0};
    check_same(hex_of(ddp::randn(std::stoll(key), g, ddp::torch_cpu_kernel::scalar)), want.get<std::vector<std::string>>(),
               "randn(" + key + "), ATEN_CPU_CAPABILITY=default");
  }
}

// ---- nn.Linear -----------------------------------------------------------------------------

TEST_CASE("torch_linear_init: bounds equal torch's doubles and float casts") {
  for (const auto& layer : load("torch_init.json")["layers"]) {
    const auto fan_in = layer["fan_in"].get<std::int64_t>();
    INFO(layer["module"].get<std::string>());
    const double weight_bound = std::strtod(layer["weight"]["bound_double_hex"].get<std::string>().c_str(), nullptr);
    const double bias_bound = std::strtod(layer["bias"]["bound_double_hex"].get<std::string>().c_str(), nullptr);
    CHECK(ddp::torch_linear_weight_bound(fan_in) == weight_bound);
    CHECK(1.0 / std::sqrt(static_cast<double>(fan_in)) == bias_bound);
    CHECK(hex_of(static_cast<float>(-weight_bound)) == layer["weight"]["from_f32_hex"].get<std::string>());
    CHECK(hex_of(static_cast<float>(weight_bound)) == layer["weight"]["to_f32_hex"].get<std::string>());
    CHECK(hex_of(static_cast<float>(weight_bound) - static_cast<float>(-weight_bound)) ==
          layer["weight"]["to_minus_from_f32_hex"].get<std::string>());
  }
}

TEST_CASE("torch_linear_init: the 24-bit draws of each parameter are the stream's words at its offset") {
  ddp::torch_generator gen{0};
  std::vector<std::int64_t> u24;
  for (int i = 0; i < 418; ++i) u24.push_back(gen.random() & 0xFFFFFF);
  for (const auto& layer : load("torch_init.json")["layers"])
    for (const char* name : {"weight", "bias"}) {
      const auto& p = layer[name];
      const auto offset = p["draw_offset"].get<std::size_t>();
      const auto count = p["draw_count"].get<std::size_t>();
      check_same(std::vector<std::int64_t>(u24.begin() + static_cast<std::ptrdiff_t>(offset),
                                           u24.begin() + static_cast<std::ptrdiff_t>(offset + count)),
                 p["u24"].get<std::vector<std::int64_t>>(), layer["module"].get<std::string>() + "." + name + " u24");
    }
}

TEST_CASE("torch_linear_init: Linear(10,32) then Linear(32,2) after manual_seed(0) equal torch bit for bit") {
  const auto& layers = load("torch_init.json")["layers"];
  ddp::torch_generator gen{0};
  const auto l1 = ddp::torch_linear_init(32, 10, gen);
  const auto l2 = ddp::torch_linear_init(2, 32, gen);
  CHECK(consumed_exactly(gen, 0, 418));
  check_same(hex_of(l1.weight), layers[0]["weight"]["hex"].get<std::vector<std::string>>(), "Linear(10,32).weight");
  check_same(hex_of(l1.bias), layers[0]["bias"]["hex"].get<std::vector<std::string>>(), "Linear(10,32).bias");
  check_same(hex_of(l2.weight), layers[1]["weight"]["hex"].get<std::vector<std::string>>(), "Linear(32,2).weight");
  check_same(hex_of(l2.bias), layers[1]["bias"]["hex"].get<std::vector<std::string>>(), "Linear(32,2).bias");
}

TEST_CASE("torch_linear_init: equals training.json initial_params (the tutorial model)") {
  const auto& params = load("training.json")["initial_params"];
  ddp::torch_generator gen{0};
  const auto l1 = ddp::torch_linear_init(32, 10, gen);
  const auto l2 = ddp::torch_linear_init(2, 32, gen);
  check_same(hex_of(l1.weight), params["0.weight"]["hex"].get<std::vector<std::string>>(), "0.weight");
  check_same(hex_of(l1.bias), params["0.bias"]["hex"].get<std::vector<std::string>>(), "0.bias");
  check_same(hex_of(l2.weight), params["2.weight"]["hex"].get<std::vector<std::string>>(), "2.weight");
  check_same(hex_of(l2.bias), params["2.bias"]["hex"].get<std::vector<std::string>>(), "2.bias");
}

TEST_CASE("torch_linear_init with torch_cpu_kernel::scalar reproduces the DEFAULT kernel (no FMA)") {
  const auto& variant = load("torch_init.json")["variants_by_cpu_capability"]["default"]["hex"];
  ddp::torch_generator gen{0};
  const auto l1 = ddp::torch_linear_init(32, 10, gen, ddp::torch_cpu_kernel::scalar);
  const auto l2 = ddp::torch_linear_init(2, 32, gen, ddp::torch_cpu_kernel::scalar);
  check_same(hex_of(l1.weight), variant["0.weight"].get<std::vector<std::string>>(), "0.weight (default)");
  check_same(hex_of(l1.bias), variant["0.bias"].get<std::vector<std::string>>(), "0.bias (default)");
  check_same(hex_of(l2.weight), variant["2.weight"].get<std::vector<std::string>>(), "2.weight (default)");
  check_same(hex_of(l2.bias), variant["2.bias"].get<std::vector<std::string>>(), "2.bias (default)");
}

// ---- randperm ------------------------------------------------------------------------------

TEST_CASE("randperm equals torch.randperm for every case in sampler.json, also with seed + 2^32") {
  for (const auto& c : load("sampler.json")["randperm"]) {
    const auto n = c["n"].get<std::int64_t>();
    const auto seed = c["seed"].get<std::uint64_t>();
    ddp::torch_generator gen{seed};
    check_same(ddp::randperm(n, gen), c["perm"].get<std::vector<std::int64_t>>(), c["call"].get<std::string>());
    CHECK(consumed_exactly(gen, seed, n > 0 ? static_cast<std::uint64_t>(n - 1) : 0));
    ddp::torch_generator wrapped{seed + (1ULL << 32)};
    CHECK(ddp::randperm(n, wrapped) == c["perm"].get<std::vector<std::int64_t>>());
  }
}

TEST_CASE("randperm(10, seed 0) is [4,1,7,5,3,9,0,8,6,2] (golden README)") {
  ddp::torch_generator gen{0};
  CHECK(ddp::randperm(10, gen) == std::vector<std::int64_t>{4, 1, 7, 5, 3, 9, 0, 8, 6, 2});
}

TEST_CASE("randperm: n = 0 gives [] without draws and negative n is rejected") {
  ddp::torch_generator gen{3};
  CHECK(ddp::randperm(0, gen).empty());
  CHECK(gen == ddp::torch_generator{3});
  CHECK_THROWS_AS(ddp::randperm(-1, gen), ddp::error);
}

TEST_CASE("randperm(100000) is a permutation and uses n-1 words") {
  ddp::torch_generator gen{42};
  const auto p = ddp::randperm(100000, gen);
  std::vector<char> seen(p.size(), 0);
  for (auto v : p) {
    REQUIRE(v >= 0);
    REQUIRE(v < 100000);
    REQUIRE(seen[static_cast<std::size_t>(v)] == 0);
    seen[static_cast<std::size_t>(v)] = 1;
  }
  CHECK(consumed_exactly(gen, 42, 99999));
}

TEST_CASE("randperm's large-n path (inside-out, random64) is a permutation and uses 2n words") {
  // torch switches to it at n = 214748364 (too big for a unit test); the same code on a small n.
  ddp::torch_generator gen{7};
  std::vector<std::int64_t> a(1000);
  ddp::detail::randperm_large(a, gen);
  std::vector<std::int64_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 0; i < sorted.size(); ++i) REQUIRE(sorted[i] == static_cast<std::int64_t>(i));
  CHECK(consumed_exactly(gen, 7, 2000));
  // First steps by hand from the raw words: a = [0]; i = 1: z = r64 % 2; a[1] = a[z]; a[z] = 1.
  ddp::torch_generator raw{7};
  (void)raw.random64();  // i = 0: z = r64 % 1 = 0
  const auto z1 = raw.random64() % 2;
  std::vector<std::int64_t> two(2);
  ddp::torch_generator g2{7};
  ddp::detail::randperm_large(two, g2);
  CHECK(two == (z1 == 0 ? std::vector<std::int64_t>{1, 0} : std::vector<std::int64_t>{0, 1}));
}

TEST_CASE("uniform rejects from > to like torch") {
  ddp::torch_generator gen{0};
  CHECK_THROWS_AS(ddp::uniform(3, 1.0, 0.5, gen), ddp::error);
  CHECK(gen == ddp::torch_generator{0});  // nothing drawn
  CHECK(ddp::uniform(2, 0.5, 0.5, gen) == std::vector<float>{0.5f, 0.5f});
}

}  // namespace ddp_test_random
