#pragma once
// ddp::checkpoint::save: writes a state as one step's directory, every file atomically, then
// index.json and DONE (the order ddp/checkpoint.hpp explains), and rotates old checkpoints.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "ddp/checkpoint/directory.hpp"
#include "ddp/checkpoint/format.hpp"
#include "ddp/checkpoint/state.hpp"
#include "ddp/checkpoint/test_hook.hpp"
#include "ddp/core/compiled.hpp"
#include "ddp/core/concepts.hpp"
#include "ddp/core/error.hpp"

namespace ddp::checkpoint {

struct save_options {
  int keep = 0;  // > 0: keep this many complete checkpoints (the newest), remove older ones
};

namespace detail {

std::vector<std::byte> index_json(std::int64_t step, int world, const state& st,
                                  const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& files);

std::vector<std::byte> encode(const state& st, scope which, std::int64_t step);

}  // namespace detail

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

// Compiled once with the compiled library (ddp/core/compiled.hpp); save() is a template over the group.
#if !DDP_DECLARATIONS_ONLY
namespace detail {

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

#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp::checkpoint
