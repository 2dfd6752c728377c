#pragma once
// The run-time interface every store implements, so a process group can hold any of them
// (std::shared_ptr<ddp::store::store>). Each implementation also models ddp::key_value_store.
//
// Semantics (the same as torch.distributed's Store):
//  - set(key, value) overwrites; get(key) waits until the key exists, up to timeout();
//  - add(key, delta) treats the value as a decimal int64 (a missing key is 0) and returns the new value;
//  - compare_set(key, expected, desired): if the key holds `expected` (or is missing and `expected`
//    is empty) it becomes `desired`; returns the value now stored (or `expected` when missing and unchanged);
//  - wait(keys, timeout) returns when all keys exist, else throws errc::timeout naming the missing ones;
//  - erase(key) returns whether it existed; num_keys() counts keys.
// Limits: keys up to max_key_bytes, values up to max_value_bytes; larger is errc::invalid_argument.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/core/concepts.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/error.hpp"

namespace ddp::store {

inline constexpr std::size_t max_key_bytes = 4096;
inline constexpr std::size_t max_value_bytes = std::size_t{64} << 20;

class store {
 public:
  virtual ~store() = default;

  virtual void set(const std::string& key, std::span<const std::byte> value) = 0;
  virtual std::vector<std::byte> get(const std::string& key) = 0;
  virtual std::int64_t add(const std::string& key, std::int64_t delta) = 0;
  virtual std::vector<std::byte> compare_set(const std::string& key, std::span<const std::byte> expected,
                                             std::span<const std::byte> desired) = 0;
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  virtual bool erase(const std::string& key) = 0;
  virtual std::int64_t num_keys() = 0;

  /// The timeout of get() and of wait() without an explicit one.
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) noexcept { timeout_ = t; }

  void wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

  // Text conveniences.
  void set_string(const std::string& key, std::string_view value) { set(key, std::as_bytes(std::span(value.data(), value.size()))); }
  std::string get_string(const std::string& key) {
    const auto bytes = get(key);
    return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }

 protected:
  static void check_key(const std::string& key) {
    if (key.empty() || key.size() > max_key_bytes) {
      throw error(errc::invalid_argument, "store key of " + std::to_string(key.size()) + " bytes: keys must be 1 to " +
                                              std::to_string(max_key_bytes) + " bytes");
    }
  }
  static void check_value(std::span<const std::byte> value) {
    if (value.size() > max_value_bytes) {
      throw error(errc::invalid_argument, "store value of " + std::to_string(value.size()) + " bytes exceeds the limit of " +
                                              std::to_string(max_value_bytes) + " bytes");
    }
  }

 private:
  std::chrono::milliseconds timeout_ = default_timeout();
};

/// Decimal int64 as stored by add().
inline std::int64_t parse_counter(std::span<const std::byte> value, const std::string& key) {
  if (value.empty()) return 0;
  std::string text(reinterpret_cast<const char*>(value.data()), value.size());
  std::size_t used = 0;
  std::int64_t n = 0;
  try {
    n = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size()) throw error(errc::invalid_argument, "store.add: key '" + key + "' does not hold an integer");
  return n;
}

/// What the store says when asked, without waiting, for a key nobody sets: errc::peer_lost with
/// the news when it has heard of a rank that died (tcp_store's departures, e.g. "rank 2 left the
/// job without a word: ..."), errc::store when it is gone with its host; nullopt otherwise. For
/// failure paths that see a peer gone and must tell the rank that died from one that exited
/// because of it. One round trip; never throws.
inline std::optional<error> store_trouble(store& st) noexcept {
  try {
    st.wait({"ddp/departure-probe"}, std::chrono::milliseconds(0));
  } catch (const error& e) {
    if (e.code() == errc::peer_lost || e.code() == errc::store) return e;
  } catch (...) {
  }
  return std::nullopt;
}

/// store_trouble's news of a rank that died, else empty.
inline std::string departure_news(store& st) noexcept {
  const auto trouble = store_trouble(st);
  return trouble && trouble->code() == errc::peer_lost ? trouble->message() : std::string();
}

/// Waits for one key per rank (`key_of(r)` for every r but `self`); on a timeout, throws
/// errc::timeout naming the ranks whose keys are still missing and what they did not publish
/// (`what`, e.g. "their heartbeat address"), with this rank in the context.
template <class KeyOf>
void wait_for_ranks(store& st, int size, int self, KeyOf&& key_of, std::chrono::milliseconds timeout, std::string_view what) {
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r)
    if (r != self) keys.push_back(key_of(r));
  try {
    st.wait(keys, timeout);
  } catch (const error& e) {
    if (e.code() != errc::timeout) throw;
    std::string missing;
    int count = 0;
    for (int r = 0; r < size; ++r) {
      if (r == self) continue;
      try {
        st.wait({key_of(r)}, std::chrono::milliseconds(1));
      } catch (const error& probe) {
        if (probe.code() != errc::timeout) throw;
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        ++count;
      }
    }
    if (count == 0) throw;
    throw error(errc::timeout, std::string(count == 1 ? "rank " : "ranks ") + missing + " did not publish " + std::string(what) +
                                   " within " + std::to_string(timeout.count()) + " ms: exited, hung, or never started?",
                {.rank = self});
  }
}

inline std::vector<std::byte> to_bytes(std::string_view text) {
  const auto* p = reinterpret_cast<const std::byte*>(text.data());
  return std::vector<std::byte>(p, p + text.size());
}

}  // namespace ddp::store
