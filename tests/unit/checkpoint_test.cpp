// ddp/checkpoint.hpp: round trips (W = 1 and W = 2, 4 as threads of one process), latest()
// skipping partial and damaged checkpoints, keep-K pruning, the messages of a mismatched load,
// the safetensors layout, the sampler's batches_from, generator state bytes, preemption's flag, and
// the elastic load (a world-size change, when allowed).

#include <ddp/checkpoint.hpp>
#include <ddp/sampler.hpp>

#include <catch2/catch.hpp>

#include <barrier>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

namespace ddp_test_checkpoint {

namespace {

namespace fs = std::filesystem;
namespace ckpt = ddp::checkpoint;

/// A fresh directory under the system's temporary directory, removed at scope exit.
struct temp_dir {
  fs::path path;
  temp_dir() {
    char tmpl[] = "/tmp/ddp_checkpoint_test.XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

/// The collectives save() uses, for ranks that are threads of this process.
struct thread_world {
  explicit thread_world(int n) : size(n), sync(n), slots(static_cast<std::size_t>(n)) {}
  int size;
  std::barrier<> sync;
  std::vector<std::vector<std::byte>> slots;
};

struct thread_group {
  thread_world* world;
  int r;
  int rank() const { return r; }
  int size() const { return world->size; }
  template <class T>
  void broadcast(std::span<T> data, int root) {
    if (r == root) world->slots[0].assign(std::as_bytes(data).begin(), std::as_bytes(data).end());
    world->sync.arrive_and_wait();
    if (r != root) std::memcpy(data.data(), world->slots[0].data(), data.size_bytes());
    world->sync.arrive_and_wait();
  }
  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    world->slots[static_cast<std::size_t>(r)].assign(std::as_bytes(in).begin(), std::as_bytes(in).end());
    world->sync.arrive_and_wait();
    for (int i = 0; i < size(); ++i)
      std::memcpy(out.data() + static_cast<std::size_t>(i) * in.size(), world->slots[static_cast<std::size_t>(i)].data(),
                  in.size_bytes());
    world->sync.arrive_and_wait();
  }
  void barrier() { world->sync.arrive_and_wait(); }
};

/// A world of one: all_reduce leaves the data as it is.
struct solo_group {
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class T, class Op>
  void all_reduce(std::span<T>, Op) {}
};

/// One rank's training state: two parameters, a momentum buffer, a history vector, a generator.
struct rank_state {
  std::vector<float> w = std::vector<float>(12), w_grad = std::vector<float>(12);
  std::vector<double> b = std::vector<double>(3), b_grad = std::vector<double>(3);
  std::vector<float> momentum = std::vector<float>(15);
  std::vector<double> history;
  ddp::torch_generator gen{7};
  std::mt19937 engine{11};

  explicit rank_state(int rank, int salt) {
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = float(salt) + 0.25f * float(i);
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = -double(salt) * 1.5 + double(i);
    for (std::size_t i = 0; i < momentum.size(); ++i) momentum[i] = float(i) / 7.0f + float(salt);
    history.assign(static_cast<std::size_t>(salt % 5 + rank), 0.5 * salt + rank);
    gen.discard(static_cast<std::uint64_t>(100 + rank));  // per-rank RNG streams
    engine.discard(static_cast<unsigned long long>(rank));
  }

  std::vector<ddp::parameter_ref> params() {
    return {ddp::make_parameter(std::span(w), std::span(w_grad), {3, 4}, "fc.weight"),
            ddp::make_parameter(std::span(b), std::span(b_grad), {}, "fc.bias")};
  }

  ckpt::state state() {
    ckpt::state st;
    st.add_parameters(params());
    st.add("optim.momentum", std::span(momentum));
    st.add_vector("train.history", history, ckpt::scope::per_rank);
    st.add_generator("rng.torch", gen);
    st.add_engine("rng.mt19937", engine);
    return st;
  }
};

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

/// std::cerr's text while f runs.
template <class F>
std::string capture_cerr(F f) {
  std::stringstream s;
  auto* old = std::cerr.rdbuf(s.rdbuf());
  try {
    f();
  } catch (...) {
    std::cerr.rdbuf(old);
    throw;
  }
  std::cerr.rdbuf(old);
  return s.str();
}

/// Saves states made with `salt` at `step` from W threads.
void save_world(const fs::path& dir, int world, std::int64_t step, int salt, ckpt::save_options options = {}) {
  thread_world tw(world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r)
    ranks.emplace_back([&, r] {
      rank_state rs(r, salt);
      auto st = rs.state();
      st.sampler = {.seed = 3, .epoch = 2, .batches_done = 5};
      st.metadata["step"] = std::to_string(step);
      thread_group g{&tw, r};
      ckpt::save(g, dir, step, st, options);
    });
  for (auto& t : ranks) t.join();
}

void flip_byte(const fs::path& p, std::size_t at) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x40);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&c, 1);
}

}  // namespace

TEST_CASE("checkpoint: round trip at W = 1, 2, 4 restores every tensor, generator, position and metadata bit for bit") {
  for (const int world : {1, 2, 4}) {
    temp_dir dir;
    save_world(dir.path, world, 123, 9);
    const auto found = ckpt::latest(dir.path);
    REQUIRE(found);
    CHECK(found->step == 123);
    CHECK(found->world_size == world);
    CHECK(found->path == ckpt::step_path(dir.path, 123));
    CHECK(found->path.filename() == "step-000000123");
    for (int r = 0; r < world; ++r) {
      rank_state expected(r, 9);
      rank_state got(r, 1);  // different values everywhere
      auto st = got.state();
      const auto info = ckpt::load(found->path, r, world, st);
      CHECK(got.w == expected.w);
      CHECK(got.b == expected.b);
      CHECK(got.momentum == expected.momentum);
      CHECK(got.history == expected.history);
      CHECK(got.gen.state() == expected.gen.state());
      CHECK(got.gen.random() == expected.gen.random());
      CHECK(got.engine == expected.engine);
      CHECK(info.step == 123);
      CHECK(info.sampler == ckpt::sampler_position{.seed = 3, .epoch = 2, .batches_done = 5});
      CHECK(st.sampler == info.sampler);
      CHECK(info.metadata.at("step") == "123");
    }
  }
}

TEST_CASE("checkpoint: the files are safetensors + index.json with sizes and CRC-32s") {
  temp_dir dir;
  save_world(dir.path, 2, 4, 9);
  const auto step = ckpt::step_path(dir.path, 4);
  for (const char* f : {"replicated.safetensors", "rank-00000.safetensors", "rank-00001.safetensors", "index.json", "DONE"})
    CHECK(fs::exists(step / f));
  for (const auto& e : fs::directory_iterator(step)) CHECK(e.path().filename().string().find(".tmp") == std::string::npos);
  const auto index = nlohmann::json::parse(read_text(step / "index.json"));
  CHECK(index["world_size"] == 2);
  CHECK(index["step"] == 4);
  CHECK(index["sampler"]["batches_done"] == 5);
  CHECK(index["tensors"]["model.fc.weight"]["dtype"] == "F32");
  CHECK(index["tensors"]["model.fc.weight"]["shape"] == nlohmann::json::array({3, 4}));
  CHECK(index["tensors"]["model.fc.bias"]["dtype"] == "F64");
  CHECK(index["files"].size() == 3);
  for (const auto& f : index["files"]) {
    const std::string text = read_text(step / f["path"].get<std::string>());
    CHECK(text.size() == f["bytes"].get<std::size_t>());
    CHECK(ckpt::detail::crc32(ckpt::detail::as_bytes(text)) == f["crc32"].get<std::uint32_t>());
  }
  // safetensors: u64 header length, a JSON header, data; offsets cover the data exactly.
  const std::string file = read_text(step / "replicated.safetensors");
  std::uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  CHECK(n % 8 == 0);
  const auto header = nlohmann::json::parse(file.substr(8, n));
  CHECK(header["model.fc.weight"]["data_offsets"][1].get<std::uint64_t>() -
            header["model.fc.weight"]["data_offsets"][0].get<std::uint64_t>() ==
        12 * 4);
  std::uint64_t end = 0;
  for (const auto& [name, t] : header.items())
    if (name != "__metadata__") end = std::max(end, t["data_offsets"][1].get<std::uint64_t>());
  CHECK(8 + n + end == file.size());
  CHECK(ckpt::detail::crc32(ckpt::detail::as_bytes("123456789")) == 0xcbf43926U);  // the CRC-32 check value
}

TEST_CASE("checkpoint: latest() skips partial and damaged checkpoints with one line each") {
  temp_dir dir;
  save_world(dir.path, 2, 10, 1);
  save_world(dir.path, 2, 20, 2);
  save_world(dir.path, 2, 30, 3);
  fs::remove(ckpt::step_path(dir.path, 30) / "DONE");                        // a save that never finished
  flip_byte(ckpt::step_path(dir.path, 20) / "rank-00001.safetensors", 200);  // damaged afterwards
  std::optional<ckpt::info> found;
  const std::string err = capture_cerr([&] { found = ckpt::latest(dir.path); });
  REQUIRE(found);
  CHECK(found->step == 10);
  CHECK(err.find("skipping " + ckpt::step_path(dir.path, 30).string() + ": incomplete (no DONE marker)") != std::string::npos);
  CHECK(err.find("skipping " + ckpt::step_path(dir.path, 20).string() + ": rank-00001.safetensors: checksum mismatch") !=
        std::string::npos);
  CHECK(std::count(err.begin(), err.end(), '\n') == 2);
  // load() of the damaged one refuses too.
  rank_state rs(1, 0);
  auto st = rs.state();
  try {
    ckpt::load(ckpt::step_path(dir.path, 20), 1, 2, st);
    FAIL("no error");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::invalid_argument);
    CHECK(std::string(e.what()).find("rank-00001.safetensors does not match its size or checksum") != std::string::npos);
  }
  fs::remove(ckpt::step_path(dir.path, 10) / "index.json");
  capture_cerr([&] { found = ckpt::latest(dir.path); });
  CHECK(!found);
  CHECK(!ckpt::latest(dir.path / "nonexistent"));
}

TEST_CASE("checkpoint: keep K removes older complete checkpoints and stale partial ones, after the new one is complete") {
  temp_dir dir;
  save_world(dir.path, 1, 1, 1);
  fs::create_directories(ckpt::step_path(dir.path, 2));  // a crashed save's leftovers
  for (int s = 3; s <= 6; ++s) save_world(dir.path, 1, s, s, {.keep = 2});
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"step-000000005", "step-000000006"});
}

TEST_CASE("checkpoint: a partial directory of the same step is replaced; a complete one is kept as it is") {
  temp_dir dir;
  const auto step = ckpt::step_path(dir.path, 7);
  fs::create_directories(step);
  std::ofstream(step / "rank-00000.safetensors.tmp.1") << "torn";
  save_world(dir.path, 1, 7, 1);
  CHECK(!fs::exists(step / "rank-00000.safetensors.tmp.1"));
  const std::string before = read_text(step / "replicated.safetensors");
  save_world(dir.path, 1, 7, 2);  // other values, same step: not rewritten
  CHECK(read_text(step / "replicated.safetensors") == before);
}

TEST_CASE("checkpoint: load names every difference of shape, dtype, missing tensor and world size") {
  temp_dir dir;
  save_world(dir.path, 2, 5, 1);
  const auto path = ckpt::step_path(dir.path, 5);

  std::vector<float> w(10), g(10);  // [2, 5] instead of [3, 4]
  std::vector<float> b(3), bg(3);   // float32 instead of float64
  std::vector<float> extra(1);
  ckpt::state st;
  st.add_parameters(std::vector<ddp::parameter_ref>{ddp::make_parameter(std::span(w), std::span(g), {2, 5}, "fc.weight"),
                                                    ddp::make_parameter(std::span(b), std::span(bg), {}, "fc.bias")});
  st.add("optim.velocity", std::span(extra));
  try {
    ckpt::load(path, 0, 2, st);
    FAIL("no error");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::config);
    const std::string m = e.what();
    CHECK(m.find("does not match this job's state:") != std::string::npos);
    CHECK(m.find("'model.fc.weight': shape [3, 4] in the checkpoint, [2, 5] here") != std::string::npos);
    CHECK(m.find("'model.fc.bias': dtype float64 in the checkpoint, float32 here") != std::string::npos);
    CHECK(m.find("'optim.velocity': not in replicated.safetensors") != std::string::npos);
  }
  CHECK(w == std::vector<float>(10));  // nothing written

  rank_state rs(0, 0);
  auto ok = rs.state();
  try {
    ckpt::load(path, 0, 4, ok);
    FAIL("no error");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::config);
    CHECK(std::string(e.what()).find("saved by a job of world size 2, this job has world size 4") != std::string::npos);
  }
}

TEST_CASE("checkpoint: a world-size change loads the replicated state and restarts the interrupted epoch, when allowed") {
  for (const auto& [saved, loading] : {std::pair{4, 2}, std::pair{2, 4}, std::pair{2, 1}}) {
    temp_dir dir;
    save_world(dir.path, saved, 40, 9);  // sampler {seed 3, epoch 2, 5 batches done}
    const auto path = ckpt::step_path(dir.path, 40);
    for (int r = 0; r < loading; ++r) {
      const rank_state expected(0, 9);  // the replicated entries are rank 0's (every rank's) values
      rank_state got(r, 1), untouched(r, 1);
      auto st = got.state();
      CHECK_THROWS_AS(ckpt::load(path, r, loading, st), ddp::error);  // the default refuses
      CHECK(got.w == untouched.w);
      const auto info = ckpt::load(path, r, loading, st, {.allow_world_size_change = true});
      CHECK(info.world_size_changed);
      CHECK(info.world_size == saved);
      CHECK(got.w == expected.w);
      CHECK(got.b == expected.b);
      CHECK(got.momentum == expected.momentum);
      // Per-rank state is another rank's: left as it was, and named.
      CHECK(got.history == untouched.history);
      CHECK(got.gen.state() == untouched.gen.state());
      CHECK(got.engine == untouched.engine);
      CHECK(info.not_loaded == std::vector<std::string>{"train.history", "rng.torch", "rng.mt19937"});
      CHECK(info.saved_sampler == ckpt::sampler_position{.seed = 3, .epoch = 2, .batches_done = 5});
      CHECK(info.sampler == ckpt::sampler_position{.seed = 3, .epoch = 2, .batches_done = 0});
      CHECK(st.sampler == info.sampler);
      CHECK(info.step == 40);
    }
  }
  // The same world size with the option set: everything loads, the position is kept.
  temp_dir dir;
  save_world(dir.path, 2, 8, 9);
  rank_state got(1, 1);
  const rank_state expected(1, 9);
  auto st = got.state();
  const auto info = ckpt::load(ckpt::step_path(dir.path, 8), 1, 2, st, {.allow_world_size_change = true});
  CHECK(!info.world_size_changed);
  CHECK(info.not_loaded.empty());
  CHECK(got.history == expected.history);
  CHECK(got.gen.state() == expected.gen.state());
  CHECK(info.sampler == ckpt::sampler_position{.seed = 3, .epoch = 2, .batches_done = 5});
}

// Without CUDA support (no ddp/checkpoint/cuda.hpp in this program) device memory is refused,
// naming the parameter and the way to CUDA support; tests/device/checkpoint_device_test has it.
TEST_CASE("checkpoint: the test hook crashes nothing unless asked, and refuses device parameters") {
  std::vector<float> v(2), g(2);
  ckpt::state st;
  REQUIRE(ckpt::detail::device_copier == nullptr);
  try {
    st.add_parameters(std::vector<ddp::parameter_ref>{
        ddp::make_parameter(std::span(v), std::span(g), {}, "x", ddp::memory_space::device)});
    FAIL("expected errc::invalid_argument");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::invalid_argument);
    CHECK_THAT(e.what(), Catch::Contains("parameter 0 ('x') is in device memory") && Catch::Contains("ddp::nccl"));
  }
  CHECK(st.entries.empty());
  // An entry put into state::entries directly is checked by save() and load(), before any file.
  st.entries.push_back({.name = "y", .type = ddp::dtype::float32, .shape = {2},
                        .data = std::as_writable_bytes(std::span(v)), .memory = ddp::memory_space::device});
  temp_dir dir;
  thread_world world(1);
  thread_group group{&world, 0};
  CHECK_THROWS_WITH(ckpt::save(group, dir.path, 1, st), Catch::Contains("entry 'y' is in device memory"));
  CHECK(fs::is_empty(dir.path));
  CHECK_THROWS_WITH(ckpt::load(dir.path, 0, 1, st), Catch::Contains("entry 'y' is in device memory"));
  st.entries.clear();
  st.add("a", std::span(v));
  CHECK_THROWS_AS(st.add("a", std::span(g)), ddp::error);
}

TEST_CASE("distributed_sampler: batches_from(b, k) is batches(b) without its first k batches") {
  ddp::distributed_sampler s{103, 2, 1, {.shuffle = true, .seed = 5, .drop_last = false, .warn = [](std::string_view) {}}};
  s.set_epoch(3);
  const auto all = s.batches(8);
  for (std::int64_t k = 0; k <= static_cast<std::int64_t>(all.size()) + 1; ++k) {
    const auto rest = s.batches_from(8, k);
    const auto skipped = std::min<std::size_t>(static_cast<std::size_t>(k), all.size());
    REQUIRE(rest.size() == all.size() - skipped);
    std::size_t i = skipped;
    for (const auto batch : rest) {
      CHECK(std::vector<std::int64_t>(batch.begin(), batch.end()) ==
            std::vector<std::int64_t>(all[i].begin(), all[i].end()));
      ++i;
    }
  }
  CHECK_THROWS_AS(s.batches_from(8, -1), ddp::error);
}

TEST_CASE("torch_generator: state bytes round trip, cached normals included; bad bytes are refused") {
  ddp::torch_generator g{123};
  g.discard(1000);
  g.set_next_double_normal_sample(0.5);
  g.set_next_float_normal_sample(-1.25f);
  const auto bytes = ddp::to_bytes(g.state());
  CHECK(bytes.size() == ddp::torch_generator_state_bytes);
  ddp::torch_generator h;
  h.set_state(ddp::torch_generator_state_from_bytes(bytes));
  CHECK(h == g);
  for (int i = 0; i < 700; ++i) REQUIRE(h.random() == g.random());
  CHECK_THROWS_AS(ddp::torch_generator_state_from_bytes(std::span(bytes).first(10)), ddp::error);
  auto bad = bytes;
  bad[8 + 4 * 624] = std::byte{0};  // left = 0
  CHECK_THROWS_AS(ddp::torch_generator_state_from_bytes(bad), ddp::error);
}

TEST_CASE("preemption: a signal sets the flag, agreed() reduces it over the group, handlers are restored") {
  solo_group group;
  struct sigaction before {};
  ::sigaction(SIGUSR1, nullptr, &before);
  {
    ddp::preemption p;
    CHECK(!p.requested());
    CHECK(!p.agreed(group));
    CHECK_THROWS_AS(ddp::preemption{}, ddp::error);  // one at a time
    ::raise(SIGUSR1);
    CHECK(p.requested());
    CHECK(p.signal() == SIGUSR1);
    CHECK(p.agreed(group));
  }
  struct sigaction after {};
  ::sigaction(SIGUSR1, nullptr, &after);
  CHECK(after.sa_handler == before.sa_handler);
  ddp::preemption again({.signals = {SIGUSR2}});
  CHECK(!again.requested());
  again.request();
  CHECK(again.requested());
  CHECK(ddp::preemption::requeue_exit_code == 75);
}

}  // namespace ddp_test_checkpoint
