#pragma once
// ddp::checkpoint: save and resume a data-parallel training job, bit for bit.
//
//   ddp::checkpoint::state st;                          // built over the objects, just before save/load
//   st.add_parameters(model);                           // the parameter_refs DDP uses (host or device memory)
//   st.add("optim.momentum", std::span(momentum));      // optimizer state: any named span
//   st.add_generator("rng.dropout", gen);               // per-rank by default
//   st.sampler = {.seed = 0, .epoch = epoch, .batches_done = b};
//   ddp::checkpoint::save(group, "ckpt", step, st, {.keep = 3});
//   ...
//   std::int64_t found[1] = {-1};                      // rank 0 chooses, so that all ranks agree
//   if (group.rank() == 0) if (auto c = ddp::checkpoint::latest("ckpt")) found[0] = c->step;
//   group.broadcast(std::span(found), 0);
//   if (found[0] >= 0) ddp::checkpoint::load(ddp::checkpoint::step_path("ckpt", found[0]), group.rank(), group.size(), st);
//   for (auto batch : sampler.batches_from(batch_size, st.sampler.batches_done)) ...
//
// On disk, one directory per step, readable without ddp (safetensors + JSON):
//   ckpt/step-000000123/replicated.safetensors    what every rank holds alike (parameters, optimizer
//                                                 state), written by rank 0
//   ckpt/step-000000123/rank-00001.safetensors    what each rank holds alone (RNG states, its loss
//                                                 sums; ZeRO's optimizer shards will go here too)
//   ckpt/step-000000123/index.json                step, world size, sampler position, metadata,
//                                                 every file's size and CRC-32, every tensor's
//                                                 file, dtype and shape
//   ckpt/step-000000123/DONE                      written last: the checkpoint is complete
//
// Why it is built this way:
//  - Each file is written under a temporary name, fsynced and renamed, then the directory is
//    fsynced, so a file under its final name is whole. DONE is written by rank 0 only after every
//    rank's files are in place (an all_gather of their sizes and checksums is the barrier), and a
//    final barrier makes save() return on every rank only once DONE is durable: a rank that exits
//    right after save() (preemption) cannot have the launcher kill rank 0 mid-write.
//  - latest() returns the newest directory with DONE whose files all have the recorded size and
//    CRC-32; others are skipped with one line on stderr. So a crash at any point of a save (or a
//    file damaged later) falls back to the previous checkpoint.
//  - A complete checkpoint of the same step is not rewritten: a step names one state, and
//    rewriting would open a window in which it is incomplete. A partial directory of that step (a
//    crashed save) is removed first.
//  - keep > 0 removes complete checkpoints beyond the newest `keep` and partial ones older than
//    the newest complete one, after DONE (never before the new one is complete).
//  - load() compares what the caller's state expects with what the checkpoint holds (world size,
//    each tensor's presence, dtype and shape) and names every difference in one errc::config
//    error. Corrupted or unreadable files are errc::invalid_argument.
//  - A checkpoint of another world size (W saved, W' loading) is refused by default: per-rank
//    state (RNG streams, loss sums, ZeRO's optimizer shards) has no meaning for a rank that did
//    not write it. With load_options::allow_world_size_change it loads (elastic resume):
//      * replicated tensors (parameters, replicated optimizer state) load as usual: every rank
//        held the same values, so they reshard to any W';
//      * per-rank tensors are not loaded: they are left as they are and named in
//        loaded::not_loaded (a caller that wants rank r's records reads them with
//        load(ckpt, r, loaded::world_size, records));
//      * the sampler restarts the interrupted epoch: st.sampler = {seed, epoch, 0}, and
//        loaded::saved_sampler keeps what was saved. Why not continue mid-epoch: a
//        DistributedSampler gives rank r the positions r, r + W, ... of the epoch's permutation,
//        so the batches a W' job would still have to take are not a suffix of its own per-rank
//        sequences (and PyTorch's sampler has no position to continue from). Restarting the epoch
//        skips no sample; the finished steps of that epoch stay in the parameters, and their
//        samples are seen once more. Why not skip to the next epoch: it would leave samples of
//        that epoch unseen. Save at an epoch's end as {epoch + 1, 0} (after its last step), as
//        train_ddp does, so that a finished epoch is never repeated.
//    latest() reads every file of the checkpoints it checks: call it once, on one rank.
//  - CRC-32 (zlib's) rather than a cryptographic hash: it guards against torn and damaged files,
//    not against an adversary, and Python checks it with zlib.crc32 (the SHA-256 in store/detail
//    sits below the process group, where the training layer does not reach).
//  - A rank whose write fails (disk full) throws errc::internal; the others fail in save()'s next
//    collective (peer lost when that rank exits, else the group's deadline), and no checkpoint of
//    that step is marked complete.
//
// The directory must be visible to every rank under the same path (one host, or a shared file
// system).
// Parameters in device memory (thrust::device_vector, CUDA tensors) need the CUDA build: with it
// (DDP_HAS_NCCL, the ddp::nccl target) this header includes ddp/checkpoint/cuda.hpp, which copies
// them with cudaMemcpy straight into the file's bytes on save and out of them on load; the file is
// the same as for host memory, so a device-saved checkpoint loads into host memory and the other
// way round, and Python reads it alike. Without it they are refused with errc::invalid_argument
// (cuda.hpp says why this header holds only a pointer to the copy functions).
//
// Test hook: DDP_CHECKPOINT_TEST_HOOK=ACTION:STEP:RANK:POINT[:FILE] makes that rank, while saving
// that step, SIGKILL itself (ACTION kill) or wait until FILE.go exists, it receives a signal of
// ddp::preemption or it is killed (pause),
// at POINT = tmp (its file fsynced under the temporary name, not renamed), done (rank 0:
// index.json in place, no DONE yet) or after (the checkpoint complete). With FILE the hook acts
// once per job (the rank that creates FILE), also across restarts. Tests interrupt at exact
// points with it instead of racing a timer.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <list>
#include <map>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp/core/env_registry.hpp"
#include "ddp/checkpoint/format.hpp"
#include "ddp/checkpoint/preemption.hpp"
#include "ddp/core/compiled.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/parameters.hpp"
#include "ddp/random/generator.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#endif

namespace ddp::checkpoint {

/// Where a tensor lives: the same on every rank (saved once, by rank 0), or one per rank.
enum class scope { replicated, per_rank };

/// The sampler's place: the run resumes with batch `batches_done` of epoch `epoch`.
struct sampler_position {
  std::int64_t seed = 0;
  std::int64_t epoch = 0;
  std::int64_t batches_done = 0;
  friend bool operator==(const sampler_position&, const sampler_position&) = default;
};

/// One named tensor of a state: saved from `data`, loaded into it (or through `assign` when the
/// size may change, e.g. a std::vector that grows during training).
struct entry {
  std::string name;
  dtype type = dtype::float32;
  std::vector<std::int64_t> shape;
  std::span<std::byte> data;
  scope where = scope::replicated;
  std::function<void(std::span<const std::byte>)> assign = {};  // set: any 1-D length is accepted
  memory_space memory = memory_space::host;  // device: `data` is device memory (ddp/checkpoint/cuda.hpp)
};

namespace detail {
/// Copies between host memory and device memory, for one named tensor (errors name it).
struct device_copy {
  void (*to_host)(std::span<std::byte> host, std::span<const std::byte> device, const std::string& tensor);
  void (*to_device)(std::span<std::byte> device, std::span<const std::byte> host, const std::string& tensor);
};
/// Set by ddp/checkpoint/cuda.hpp (CUDA) when the program starts; null: device memory is refused.
inline const device_copy* device_copier = nullptr;

/// Refuses an entry in device memory that cannot be copied. state's own functions check when they
/// add; save() and load() check again for entries put into state::entries directly.
void check_memory(const entry& e);
}  // namespace detail

/// What a checkpoint holds: named tensors over the caller's memory, the sampler position and
/// small string metadata (step, loss, ...). Build it over your objects just before save() or
/// load(): the spans point into them, and generators are snapshot when added.
class state {
 public:
  std::vector<entry> entries;
  sampler_position sampler{};
  std::map<std::string, std::string> metadata;

  /// Every parameter's values (not the gradients), named prefix + its name (or index when it has
  /// none). Host memory, and device memory in the CUDA build (the header comment says how).
  state& add_parameters(const std::vector<parameter_ref>& params, const std::string& prefix = "model.");
  template <parameter_container P>
    requires(!std::same_as<std::remove_cvref_t<P>, std::vector<parameter_ref>>)
  state& add_parameters(P& model, const std::string& prefix = "model.") {
    return add_parameters(ddp::parameters(model), prefix);
  }

  /// A fixed-size tensor (optimizer state, a scalar as a span of one). Empty shape: 1-D.
  template <dtype_like T>
  state& add(std::string name, std::span<T> data, std::vector<std::int64_t> shape = {}, scope where = scope::replicated) {
    static_assert(!std::is_const_v<T>, "checkpoint: load writes into the span");
    if (shape.empty()) shape.push_back(static_cast<std::int64_t>(data.size()));
    return push(entry{.name = std::move(name), .type = dtype_of<T>, .shape = std::move(shape),
                      .data = std::as_writable_bytes(data), .where = where, .assign = {}, .memory = memory_space::host});
  }
  /// A vector whose length may differ at load (it is resized): per-epoch histories, logs.
  template <dtype_like T>
  state& add_vector(std::string name, std::vector<T>& v, scope where = scope::replicated) {
    return push(entry{.name = std::move(name), .type = dtype_of<T>, .shape = {static_cast<std::int64_t>(v.size())},
                      .data = std::as_writable_bytes(std::span<T>(v)), .where = where,
                      .assign = [&v](std::span<const std::byte> bytes) {
                        v.resize(bytes.size() / sizeof(T));
                        if (!bytes.empty()) std::memcpy(v.data(), bytes.data(), bytes.size());
                      },
                      .memory = memory_space::host});
  }
  /// Opaque bytes (any RNG's state, a tokenizer's position...): `bytes` is saved as uint8, and on
  /// load `restore` gets the saved bytes.
  state& add_bytes(std::string name, std::vector<std::byte> bytes, std::function<void(std::span<const std::byte>)> restore,
                   scope where = scope::per_rank);
  /// A torch_generator, as its state bytes (random/generator.hpp's layout).
  state& add_generator(std::string name, torch_generator& gen, scope where = scope::per_rank);
  /// Any standard random engine (std::mt19937, ...), through its text form (operator<< / >>).
  template <class Engine>
    requires requires(std::ostream& os, std::istream& is, Engine& e) {
      os << e;
      is >> e;
    }
  state& add_engine(std::string name, Engine& engine, scope where = scope::per_rank) {
    std::ostringstream os;
    os << engine;
    const std::string text = os.str();
    const auto b = detail::as_bytes(text);
    return add_bytes(std::move(name), std::vector<std::byte>(b.begin(), b.end()),
                     [&engine](std::span<const std::byte> saved) {
                       std::istringstream is(std::string(reinterpret_cast<const char*>(saved.data()), saved.size()));
                       is >> engine;
                     },
                     where);
  }

  const entry* find(std::string_view name) const noexcept;

 private:
  state& push(entry e);
  std::list<std::vector<std::byte>> owned_;  // snapshots of generators; a list keeps them in place
};

/// A complete checkpoint found by latest().
struct info {
  std::filesystem::path path;  // dir/step-000000123
  std::int64_t step = 0;
  int world_size = 0;
};

/// What load() read besides the tensors.
struct loaded {
  std::int64_t step = 0;
  int world_size = 0;                   // the world size that saved it
  sampler_position sampler{};           // where to resume (the saved position, or the epoch's start)
  std::map<std::string, std::string> metadata;
  bool world_size_changed = false;      // world_size differs from the loading job's
  sampler_position saved_sampler{};     // as saved
  std::vector<std::string> not_loaded;  // per-rank entries left as they were (world size changed)
};

struct load_options {
  /// Load a checkpoint saved by a job of another world size: replicated entries only, and the
  /// interrupted epoch restarts (see the header comment). Off: such a checkpoint is errc::config.
  bool allow_world_size_change = false;
};

struct save_options {
  int keep = 0;  // > 0: keep this many complete checkpoints (the newest), remove older ones
};

inline constexpr std::string_view replicated_file = "replicated.safetensors";
inline constexpr std::string_view index_file = "index.json";
inline constexpr std::string_view done_file = "DONE";

/// dir/step-000000123 (nine digits, so names sort like steps up to 10^9).
std::filesystem::path step_path(const std::filesystem::path& dir, std::int64_t step);

std::string rank_file(int rank);

namespace detail {

std::optional<std::int64_t> step_of(const std::filesystem::path& p);

/// Step directories under dir, newest first.
std::vector<std::pair<std::int64_t, std::filesystem::path>> step_dirs(const std::filesystem::path& dir);

// The step save() is writing, for the hook; per thread: tests run ranks as threads.
inline thread_local std::int64_t saving_step = -1;
inline thread_local int saving_rank = -1;

/// The test hook: at `point` of saving its step, the rank kills itself (SIGKILL) or stops until a
/// test kills it. With FILE, only the first rank that creates FILE acts (once per job, also
/// across restarts); FILE tells the test that the rank is there.
void test_point(std::string_view point);

void before_rename(const std::filesystem::path&);

/// index.json, parsed and checked for the fields latest() and load() need.
struct index {
  std::int64_t step = 0;
  int world_size = 0;
  sampler_position sampler{};
  std::map<std::string, std::string> metadata;
  struct file {
    std::string path;
    std::uint64_t bytes = 0;
    std::uint32_t crc = 0;
  };
  std::vector<file> files;
};

index read_index(const std::filesystem::path& ckpt);

/// Empty when the checkpoint is complete and every file matches the index; else why not.
std::string verify(const std::filesystem::path& ckpt, int world_size_expected = -1);

void prune(const std::filesystem::path& dir, int keep);

std::vector<std::byte> index_json(std::int64_t step, int world, const state& st,
                                  const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& files);

std::vector<std::byte> encode(const state& st, scope which, std::int64_t step);

}  // namespace detail

/// The newest complete, intact checkpoint under dir, or nullopt. Every skipped directory (no DONE,
/// bad index, a file missing, wrong size or checksum) gets one line on stderr.
std::optional<info> latest(const std::filesystem::path& dir);

/// Saves `st` as checkpoint `step` under dir; a collective: every rank of the group calls it with
/// the same step. Returns the checkpoint's directory once it is complete on every rank.
template <class Group>
std::filesystem::path save(Group& group, const std::filesystem::path& dir, std::int64_t step, const state& st,
                           save_options options = {}) {
  for (const auto& e : st.entries) detail::check_memory(e);
  const int rank = group.rank(), world = group.size();
  const auto path = step_path(dir, step);
  detail::saving_step = step;
  detail::saving_rank = rank;
  // Rank 0 decides whether this step is already saved and clears a partial one; the broadcast
  // keeps the other ranks from writing into the directory before that.
  std::vector<std::int64_t> skip{0};
  if (rank == 0) {
    std::error_code ec;
    if (std::filesystem::exists(path / done_file, ec)) {
      skip[0] = 1;
    } else {
      std::filesystem::remove_all(path, ec);
      std::filesystem::create_directories(path, ec);
      if (ec)
        throw error(errc::internal, "checkpoint: cannot create '" + path.string() + "': " + ec.message(), {.op = "checkpoint"});
    }
  }
  group.broadcast(std::span<std::int64_t>(skip), 0);
  if (skip[0] != 0) return path;

  const auto mine = detail::encode(st, scope::per_rank, step);
  detail::write_file_atomically(path / rank_file(rank), mine, &detail::before_rename);
  std::vector<std::byte> shared;
  if (rank == 0) {
    shared = detail::encode(st, scope::replicated, step);
    detail::write_file_atomically(path / replicated_file, shared, &detail::before_rename);
  }
  // Every rank's file is in place once this returns: it is the barrier before DONE.
  const std::vector<std::int64_t> sums{static_cast<std::int64_t>(mine.size()), static_cast<std::int64_t>(detail::crc32(mine))};
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(world));
  group.all_gather(std::span<const std::int64_t>(sums), std::span<std::int64_t>(all));
  if (rank == 0) {
    std::vector<std::pair<std::string, std::vector<std::int64_t>>> files;
    files.push_back({std::string(replicated_file),
                     {-1, static_cast<std::int64_t>(shared.size()), static_cast<std::int64_t>(detail::crc32(shared))}});
    for (int r = 0; r < world; ++r)
      files.push_back({rank_file(r), {r, all[2 * static_cast<std::size_t>(r)], all[2 * static_cast<std::size_t>(r) + 1]}});
    detail::write_file_atomically(path / index_file, detail::index_json(step, world, st, files));
    detail::test_point("done");
    detail::write_file_atomically(path / done_file, detail::as_bytes("complete\n"));
    if (options.keep > 0) detail::prune(dir, options.keep);
  }
  group.barrier();
  detail::test_point("after");
  return path;
}

/// Loads checkpoint `ckpt` (a step directory) into `st` for rank `rank` of `world_size`: every
/// entry must be present with its dtype and shape (entries made by add_vector / add_bytes take any
/// length). All differences are named in one errc::config error before anything is written.
/// Tensors in the checkpoint that `st` does not name are ignored.
/// With options.allow_world_size_change, a checkpoint of another world size loads its replicated
/// entries, and the sampler restarts the interrupted epoch (the header comment says why).
loaded load(const std::filesystem::path& ckpt, int rank, int world_size, state& st, load_options options = {});

// Compiled once with the compiled library (ddp/core/compiled.hpp); save() is a template over the group.
#if !DDP_DECLARATIONS_ONLY
namespace detail {

DDP_COMPILED_INLINE void check_memory(const entry& e) {
  if (e.memory != memory_space::device) return;
  if (e.assign)
    throw error(errc::invalid_argument, "checkpoint: entry '" + e.name + "' is in device memory, which a resizable entry cannot be",
                {.op = "checkpoint"});
  if (device_copier == nullptr)
    throw error(errc::invalid_argument,
                "checkpoint: entry '" + e.name + "' is in device memory, and this program is not built with CUDA support for "
                "checkpoints (the CMake target ddp::nccl, or <ddp/checkpoint/cuda.hpp> and CUDA::cudart)",
                {.op = "checkpoint"});
}

}  // namespace detail

DDP_COMPILED_INLINE state& state::add_parameters(const std::vector<parameter_ref>& params, const std::string& prefix) {
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    if (p.memory == memory_space::device && detail::device_copier == nullptr)
      throw error(errc::invalid_argument,
                  "checkpoint: " + describe_parameter(i, p.name) +
                      " is in device memory, and this program is not built with CUDA support for checkpoints: "
                      "link the CMake target ddp::nccl (or include <ddp/checkpoint/cuda.hpp> and link "
                      "CUDA::cudart), or copy it to host first",
                  {.op = "checkpoint"});
    push(entry{.name = prefix + (p.name.empty() ? std::to_string(i) : p.name), .type = p.type, .shape = p.shape,
               .data = p.value, .where = scope::replicated, .assign = {}, .memory = p.memory});
  }
  return *this;
}

DDP_COMPILED_INLINE state& state::add_bytes(std::string name, std::vector<std::byte> bytes, std::function<void(std::span<const std::byte>)> restore,
                                            scope where) {
  auto& kept = owned_.emplace_back(std::move(bytes));
  return push(entry{.name = std::move(name), .type = dtype::uint8, .shape = {static_cast<std::int64_t>(kept.size())},
                    .data = kept, .where = where, .assign = std::move(restore), .memory = memory_space::host});
}

DDP_COMPILED_INLINE state& state::add_generator(std::string name, torch_generator& gen, scope where) {
  return add_bytes(std::move(name), to_bytes(gen.state()),
                   [&gen](std::span<const std::byte> b) { gen.set_state(torch_generator_state_from_bytes(b)); }, where);
}

DDP_COMPILED_INLINE const entry* state::find(std::string_view name) const noexcept {
  for (const auto& e : entries)
    if (e.name == name) return &e;
  return nullptr;
}

DDP_COMPILED_INLINE state& state::push(entry e) {
  if (find(e.name) != nullptr)
    throw error(errc::invalid_argument, "checkpoint: two entries are named '" + e.name + "'", {.op = "checkpoint"});
  detail::check_memory(e);
  std::int64_t numel = 1;
  for (const auto d : e.shape) numel *= d;
  if (numel * static_cast<std::int64_t>(size_of(e.type)) != static_cast<std::int64_t>(e.data.size()))
    throw error(errc::invalid_argument,
                "checkpoint: entry '" + e.name + "': shape " + shape_string(e.shape) + " does not match its " +
                    std::to_string(e.data.size()) + " bytes",
                {.op = "checkpoint"});
  entries.push_back(std::move(e));
  return *this;
}

DDP_COMPILED_INLINE std::filesystem::path step_path(const std::filesystem::path& dir, std::int64_t step) {
  char b[32];
  std::snprintf(b, sizeof b, "step-%09lld", static_cast<long long>(step));
  return dir / b;
}

DDP_COMPILED_INLINE std::string rank_file(int rank) {
  char b[40];
  std::snprintf(b, sizeof b, "rank-%05d.safetensors", rank);
  return b;
}

namespace detail {

DDP_COMPILED_INLINE std::optional<std::int64_t> step_of(const std::filesystem::path& p) {
  const std::string name = p.filename().string();
  if (name.size() < 6 || name.compare(0, 5, "step-") != 0) return std::nullopt;
  for (std::size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
  return std::strtoll(name.c_str() + 5, nullptr, 10);
}

DDP_COMPILED_INLINE std::vector<std::pair<std::int64_t, std::filesystem::path>> step_dirs(const std::filesystem::path& dir) {
  std::vector<std::pair<std::int64_t, std::filesystem::path>> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (const auto s = step_of(it->path()); s && it->is_directory(ec)) out.emplace_back(*s, it->path());
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

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

DDP_COMPILED_INLINE index read_index(const std::filesystem::path& ckpt) {
  const auto bytes = read_file(ckpt / index_file);
  if (!bytes) throw std::invalid_argument("index.json is missing or unreadable");
  const json j = parse_json(std::string_view(reinterpret_cast<const char*>(bytes->data()), bytes->size()));
  const auto need = [&](const json& obj, std::string_view key) -> const json& {
    const json* v = obj.find(key);
    if (v == nullptr) throw std::invalid_argument("index.json has no \"" + std::string(key) + "\"");
    return *v;
  };
  index out;
  out.step = need(j, "step").as_int();
  out.world_size = static_cast<int>(need(j, "world_size").as_int());
  const json& s = need(j, "sampler");
  out.sampler = {.seed = need(s, "seed").as_int(), .epoch = need(s, "epoch").as_int(),
                 .batches_done = need(s, "batches_done").as_int()};
  if (const json* m = j.find("metadata"))
    for (std::size_t i = 0; i < m->keys.size(); ++i) out.metadata[m->keys[i]] = m->items[i].text;
  for (const json& f : need(j, "files").items)
    out.files.push_back({.path = need(f, "path").text, .bytes = static_cast<std::uint64_t>(need(f, "bytes").as_int()),
                         .crc = static_cast<std::uint32_t>(need(f, "crc32").as_int())});
  return out;
}

DDP_COMPILED_INLINE std::string verify(const std::filesystem::path& ckpt, int world_size_expected) {
  std::error_code ec;
  if (!std::filesystem::exists(ckpt / done_file, ec)) return "incomplete (no DONE marker)";
  index idx;
  try {
    idx = read_index(ckpt);
  } catch (const std::exception& e) {
    return std::string("bad index.json: ") + e.what();
  }
  if (world_size_expected > 0 && idx.world_size != world_size_expected)
    return "saved by " + std::to_string(idx.world_size) + " ranks, this job has " + std::to_string(world_size_expected);
  for (const auto& f : idx.files) {
    const auto bytes = read_file(ckpt / f.path);
    if (!bytes) return f.path + " is missing";
    if (bytes->size() != f.bytes)
      return f.path + " has " + std::to_string(bytes->size()) + " bytes, index.json says " + std::to_string(f.bytes);
    if (const auto crc = crc32(*bytes); crc != f.crc)
      return f.path + ": checksum mismatch (crc32 " + std::to_string(crc) + ", index.json says " + std::to_string(f.crc) + ")";
  }
  return {};
}

DDP_COMPILED_INLINE void prune(const std::filesystem::path& dir, int keep) {
  int complete = 0;
  std::optional<std::int64_t> newest_complete;
  for (const auto& [step, path] : step_dirs(dir)) {
    std::error_code ec;
    const bool done = std::filesystem::exists(path / done_file, ec);
    if (done && complete < keep) {
      ++complete;
      if (!newest_complete) newest_complete = step;
      continue;
    }
    // Partial directories newer than the newest complete one may be a save in progress elsewhere.
    if (!done && (!newest_complete || step > *newest_complete)) continue;
    // DONE goes first: a checkpoint half removed must read as incomplete, never as complete.
    std::filesystem::remove(path / done_file, ec);
    std::filesystem::remove_all(path, ec);
  }
}

DDP_COMPILED_INLINE std::vector<std::byte> index_json(std::int64_t step, int world, const state& st,
                                                      const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& files) {
  std::string s = "{\n  \"format\": \"ddp.checkpoint\",\n  \"version\": 1,\n";
  s += "  \"step\": " + std::to_string(step) + ",\n";
  s += "  \"world_size\": " + std::to_string(world) + ",\n";
  s += "  \"sampler\": {\"seed\": " + std::to_string(st.sampler.seed) + ", \"epoch\": " + std::to_string(st.sampler.epoch) +
       ", \"batches_done\": " + std::to_string(st.sampler.batches_done) + "},\n";
  s += "  \"metadata\": {";
  bool first = true;
  for (const auto& [k, v] : st.metadata) {
    s += (first ? "" : ", ") + json_quote(k) + ": " + json_quote(v);
    first = false;
  }
  s += "},\n  \"files\": [\n";
  for (std::size_t i = 0; i < files.size(); ++i) {
    const auto& [path, v] = files[i];  // v: rank (-1 replicated), bytes, crc32
    s += "    {\"path\": " + json_quote(path) + ", \"scope\": \"" + (v[0] < 0 ? "replicated" : "per_rank") + "\"" +
         (v[0] < 0 ? std::string() : ", \"rank\": " + std::to_string(v[0])) + ", \"bytes\": " + std::to_string(v[1]) +
         ", \"crc32\": " + std::to_string(v[2]) + "}" + (i + 1 < files.size() ? ",\n" : "\n");
  }
  // Tensors as rank 0 sees them; per-rank tensors have the same names in every rank's file
  // (their shapes may differ per rank: each file's safetensors header is authoritative).
  s += "  ],\n  \"tensors\": {\n";
  for (std::size_t i = 0; i < st.entries.size(); ++i) {
    const auto& e = st.entries[i];
    s += "    " + json_quote(e.name) + ": {\"scope\": \"" + (e.where == scope::replicated ? "replicated" : "per_rank") +
         "\", \"file\": " +
         json_quote(e.where == scope::replicated ? std::string(replicated_file) : std::string("rank-{rank:05d}.safetensors")) +
         ", \"dtype\": \"" + std::string(safetensors_dtype(e.type)) + "\", \"shape\": " + json_shape(e.shape) + "}" +
         (i + 1 < st.entries.size() ? ",\n" : "\n");
  }
  s += "  }\n}\n";
  const auto b = as_bytes(s);
  return {b.begin(), b.end()};
}

DDP_COMPILED_INLINE std::vector<std::byte> encode(const state& st, scope which, std::int64_t step) {
  std::vector<tensor_out> tensors;
  for (const auto& e : st.entries)
    if (e.where == which) {
      tensors.push_back({.name = e.name, .type = e.type, .shape = e.shape, .data = e.data, .fill = {}});
      if (e.memory == memory_space::device)
        tensors.back().fill = [&e](std::span<std::byte> out) { device_copier->to_host(out, e.data, e.name); };
    }
  std::vector<std::pair<std::string, std::string>> meta{{"format", "ddp.checkpoint"}, {"step", std::to_string(step)}};
  if (which == scope::replicated)
    for (const auto& kv : st.metadata) meta.emplace_back(kv.first, kv.second);
  return encode_safetensors(tensors, meta);
}

}  // namespace detail

DDP_COMPILED_INLINE std::optional<info> latest(const std::filesystem::path& dir) {
  for (const auto& [step, path] : detail::step_dirs(dir)) {
    if (const std::string why = detail::verify(path); !why.empty()) {
      std::cerr << "ddp: checkpoint: skipping " + path.string() + ": " + why + "\n";
      continue;
    }
    return info{.path = path, .step = step, .world_size = detail::read_index(path).world_size};
  }
  return std::nullopt;
}

DDP_COMPILED_INLINE loaded load(const std::filesystem::path& ckpt, int rank, int world_size, state& st, load_options options) {
  for (const auto& e : st.entries) detail::check_memory(e);
  const auto bad = [&](const std::string& what) {
    return error(errc::invalid_argument, "checkpoint " + ckpt.string() + ": " + what, {.op = "checkpoint.load"});
  };
  detail::index idx;
  try {
    idx = detail::read_index(ckpt);
  } catch (const std::exception& e) {
    throw bad(e.what());
  }
  const bool changed = idx.world_size != world_size;
  if (changed && !options.allow_world_size_change)
    throw error(errc::config,
                "checkpoint " + ckpt.string() + " was saved by a job of world size " + std::to_string(idx.world_size) +
                    ", this job has world size " + std::to_string(world_size) +
                    " (per-rank state and the sampler position need the same world size; "
                    "load_options::allow_world_size_change loads the replicated state and restarts the interrupted epoch)",
                {.op = "checkpoint.load"});
  const auto read = [&](const std::string& name) {
    auto bytes = detail::read_file(ckpt / name);
    if (!bytes) throw bad(name + " is missing or unreadable");
    for (const auto& f : idx.files)
      if (f.path == name && (bytes->size() != f.bytes || detail::crc32(*bytes) != f.crc))
        throw bad(name + " does not match its size or checksum in index.json (damaged)");
    return std::move(*bytes);
  };
  const auto shared_bytes = read(std::string(replicated_file));
  // After a world-size change this rank's file is not read: it may not exist, and it is another rank's.
  const auto own_bytes = changed ? std::vector<std::byte>{} : read(rank_file(rank));
  detail::safetensors_file shared, own;
  try {
    shared = detail::decode_safetensors(shared_bytes);
    if (!changed) own = detail::decode_safetensors(own_bytes);
  } catch (const std::exception& e) {
    throw bad(e.what());
  }
  std::string diff;
  std::vector<std::pair<const entry*, const detail::tensor_in*>> plan;
  std::vector<std::string> not_loaded;
  for (const auto& e : st.entries) {
    if (changed && e.where == scope::per_rank) {
      not_loaded.push_back(e.name);
      continue;
    }
    const auto& file = e.where == scope::replicated ? shared : own;
    const std::string where = e.where == scope::replicated ? std::string(replicated_file) : rank_file(rank);
    const auto* t = file.find(e.name);
    if (t == nullptr) {
      diff += "\n  '" + e.name + "': not in " + where;
      continue;
    }
    if (t->type != e.type) {
      diff += "\n  '" + e.name + "': dtype " + std::string(to_string(t->type)) + " in the checkpoint, " +
              std::string(to_string(e.type)) + " here";
      continue;
    }
    if (e.assign ? t->shape.size() != 1 : t->shape != e.shape) {
      diff += "\n  '" + e.name + "': shape " + shape_string(t->shape) + " in the checkpoint, " +
              (e.assign ? std::string("1-D") : shape_string(e.shape)) + " here";
      continue;
    }
    plan.emplace_back(&e, t);
  }
  if (!diff.empty())
    throw error(errc::config, "checkpoint " + ckpt.string() + " does not match this job's state:" + diff,
                {.op = "checkpoint.load"});
  for (const auto& [e, t] : plan) {
    if (e->assign)
      e->assign(t->data);
    else if (e->memory == memory_space::device)
      detail::device_copier->to_device(e->data, t->data, e->name);
    else if (!t->data.empty())
      std::memcpy(e->data.data(), t->data.data(), t->data.size());
  }
  const sampler_position resume =
      changed ? sampler_position{.seed = idx.sampler.seed, .epoch = idx.sampler.epoch, .batches_done = 0} : idx.sampler;
  st.sampler = resume;
  st.metadata = idx.metadata;
  return {.step = idx.step, .world_size = idx.world_size, .sampler = resume, .metadata = idx.metadata,
          .world_size_changed = changed, .saved_sampler = idx.sampler, .not_loaded = std::move(not_loaded)};
}
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp::checkpoint

// The CUDA build saves and loads device memory (ddp/checkpoint/cuda.hpp says why it is apart).
#if defined(DDP_HAS_NCCL)
#include "ddp/checkpoint/cuda.hpp"
#endif
