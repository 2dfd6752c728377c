#pragma once
// Deadlines: every blocking call in ddp takes one.
//
// The default timeout is 300 s, or DDP_TIMEOUT (seconds, may be fractional) when set.

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

#include "ddp/core/env_registry.hpp"
#include "ddp/core/compiled.hpp"
#include "ddp/core/error.hpp"

namespace ddp {

using clock = std::chrono::steady_clock;

class deadline {
 public:
  /// A deadline that never expires.
  constexpr deadline() noexcept : at_(clock::time_point::max()) {}
  explicit constexpr deadline(clock::time_point at) noexcept : at_(at) {}

  /// Timeouts beyond what the clock can represent from now (~292 years) mean never.
  template <class Rep, class Period>
  static deadline after(std::chrono::duration<Rep, Period> timeout) noexcept {
    const auto now = clock::now();
    if (timeout <= timeout.zero()) return deadline(now);
    // Compare in floating seconds first: casting a huge timeout in coarse units (hours::max(),
    // milliseconds::max()) to the clock's nanoseconds would overflow. The margin absorbs the
    // double's rounding so that the cast below cannot pass time_point::max().
    const std::chrono::duration<double> limit = clock::time_point::max() - now;
    if (std::chrono::duration<double>(timeout) >= limit * 0.999) return deadline();
    return deadline(now + std::chrono::duration_cast<clock::duration>(timeout));
  }
  static constexpr deadline never() noexcept { return deadline(); }

  constexpr clock::time_point time_point() const noexcept { return at_; }
  constexpr bool is_never() const noexcept { return at_ == clock::time_point::max(); }
  bool expired() const noexcept { return !is_never() && clock::now() >= at_; }

  /// Time left, zero when expired; a huge value for never().
  std::chrono::milliseconds remaining() const noexcept {
    if (is_never()) return std::chrono::milliseconds::max();
    const auto left = at_ - clock::now();
    if (left <= clock::duration::zero()) return std::chrono::milliseconds::zero();
    return std::chrono::ceil<std::chrono::milliseconds>(left);
  }

  /// Timeout argument for poll(2): -1 for never, otherwise the remaining milliseconds (capped).
  int poll_timeout_ms() const noexcept {
    if (is_never()) return -1;
    const auto ms = remaining().count();
    return ms > std::numeric_limits<int>::max() ? std::numeric_limits<int>::max() : static_cast<int>(ms);
  }

  friend constexpr bool operator==(const deadline&, const deadline&) = default;
  friend constexpr auto operator<=>(const deadline& a, const deadline& b) noexcept { return a.at_ <=> b.at_; }

 private:
  clock::time_point at_;
};

namespace detail {
/// DDP_TIMEOUT's rules applied to a given text (also used by launch_env with an injected lookup).
std::chrono::milliseconds parse_timeout(const char* text);
}  // namespace detail

/// DDP_TIMEOUT (seconds) or 300 s. A malformed value is a ddp::error naming the variable.
std::chrono::milliseconds default_timeout();

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
namespace detail {
DDP_COMPILED_INLINE std::chrono::milliseconds parse_timeout(const char* text) {
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(seconds > 0) || seconds > 1e9) {
    throw error(errc::config, std::string("DDP_TIMEOUT='") + text + "' is not a positive number of seconds (e.g. DDP_TIMEOUT=300)");
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000.0 + 0.5));
}
}  // namespace detail

DDP_COMPILED_INLINE std::chrono::milliseconds default_timeout() {
  const char* text = read_env_nonempty("DDP_TIMEOUT");
  if (text == nullptr) return std::chrono::seconds(300);
  return detail::parse_timeout(text);
}
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp
