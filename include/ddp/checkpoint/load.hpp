#pragma once
// ddp::checkpoint::load: reads one step's directory into a state, after checking the files
// against index.json and the state against the files; the world-size-change rules.

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "ddp/checkpoint/state.hpp"
#include "ddp/core/compiled.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <cstring>
#include <exception>
#include <utility>

#include "ddp/checkpoint/directory.hpp"
#include "ddp/checkpoint/format.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#include "ddp/parameters.hpp"
#endif

namespace ddp::checkpoint {

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
  /// interrupted epoch restarts (see ddp/checkpoint.hpp). Off: such a checkpoint is errc::config.
  bool allow_world_size_change = false;
};

/// Loads checkpoint `ckpt` (a step directory) into `st` for rank `rank` of `world_size`: every
/// entry must be present with its dtype and shape (entries made by add_vector / add_bytes take any
/// length). All differences are named in one errc::config error before anything is written.
/// Tensors in the checkpoint that `st` does not name are ignored.
/// With options.allow_world_size_change, a checkpoint of another world size loads its replicated
/// entries, and the sampler restarts the interrupted epoch (ddp/checkpoint.hpp says why).
loaded load(const std::filesystem::path& ckpt, int rank, int world_size, state& st, load_options options = {});

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
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
