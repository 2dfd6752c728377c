#pragma once
// ddp::checkpoint::state: the named tensors (entries over the caller's memory), the sampler
// position and the metadata that a checkpoint saves and loads; and the hook that copies entries
// in device memory (set by ddp/checkpoint/cuda.hpp).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <list>
#include <map>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp/checkpoint/format.hpp"
#include "ddp/core/compiled.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/parameters.hpp"
#include "ddp/random/generator.hpp"

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
  /// none). Host memory, and device memory in the CUDA build (ddp/checkpoint.hpp says how).
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

// Compiled once with the compiled library (ddp/core/compiled.hpp).
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
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp::checkpoint
