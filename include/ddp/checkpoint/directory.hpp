#pragma once
// A checkpoint directory on disk: the file names, the step directories, index.json as read back,
// the check that a checkpoint is complete and intact, latest(), and the rotation that keeps the
// newest `keep` (prune).

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ddp/checkpoint/format.hpp"
#include "ddp/checkpoint/state.hpp"
#include "ddp/core/compiled.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <stdexcept>
#include <system_error>
#endif

namespace ddp::checkpoint {

/// A complete checkpoint found by latest().
struct info {
  std::filesystem::path path;  // dir/step-000000123
  std::int64_t step = 0;
  int world_size = 0;
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
std::string verify(const std::filesystem::path& ckpt);

void prune(const std::filesystem::path& dir, int keep);

}  // namespace detail

/// The newest complete, intact checkpoint under dir, or nullopt. Every skipped directory (no DONE,
/// bad index, a file missing, wrong size or checksum) gets one line on stderr.
std::optional<info> latest(const std::filesystem::path& dir);

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
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

DDP_COMPILED_INLINE std::string verify(const std::filesystem::path& ckpt) {
  std::error_code ec;
  if (!std::filesystem::exists(ckpt / done_file, ec)) return "incomplete (no DONE marker)";
  index idx;
  try {
    idx = read_index(ckpt);
  } catch (const std::exception& e) {
    return std::string("bad index.json: ") + e.what();
  }
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

#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp::checkpoint
