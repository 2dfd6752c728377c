#pragma once
// The forms of the launch environment's values: integers, ports, Slurm's tasks-per-node counts
// and host lists, the loopback test and the default port of a job id. A bad value is a
// ddp::error(errc::config) that names the variable and the expected form.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/core/compiled.hpp"
#include "ddp/core/error.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <algorithm>
#include <utility>
#endif

namespace ddp {

namespace detail {

[[noreturn]] void config_error(std::string message);

inline bool all_digits(std::string_view s) noexcept {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

/// Parses a decimal integer (optional leading '-'); nullopt when malformed or beyond int64.
inline std::optional<std::int64_t> parse_int64(std::string_view s) noexcept {
  const bool negative = !s.empty() && s.front() == '-';
  if (negative) s.remove_prefix(1);
  if (!all_digits(s) || s.size() > 18) return std::nullopt;
  std::int64_t v = 0;
  for (char c : s) v = v * 10 + (c - '0');
  return negative ? -v : v;
}

/// The variable `name`, which must hold an integer >= `min_value`; `example` is a valid value.
int env_int(std::string_view name, const char* text, int min_value, std::string_view example);

int parse_port(std::string_view name, const char* text);

/// Whether a master address names this host only (127.x.x.x, ::1, localhost).
inline bool is_loopback(std::string_view addr) noexcept {
  return addr == "localhost" || addr == "::1" || addr == "[::1]" || addr.substr(0, 4) == "127.";
}

/// The default port of a job with an identity (see ddp/core/env.hpp): 20000 + n % 12768,
/// n = JOB + 7919 x STEP for an id "<launcher>:JOB" or "<launcher>:JOB.STEP" of digits, else an
/// FNV-1a hash of the whole id.
int port_from_job_id(std::string_view job_id) noexcept;

/// The ports a derived port's store moves to, in order, when something else holds it: 7 more of
/// 20000-32767, 4099 apart (prime to the range, so they are distinct, and apart from the ports of
/// the neighbouring job ids).
std::vector<int> derived_port_alternates(int port);

/// Slurm's tasks-per-node syntax, "2(x3),1" -> {2, 2, 2, 1}.
std::vector<int> expand_tasks_per_node(std::string_view name, std::string_view text);

}  // namespace detail

/// Expands a Slurm host list: "node[01-03,7],gpu5" -> node01 node02 node03 node7 gpu5.
/// Zero padding follows the lower bound ("[08-10]" -> 08 09 10); several bracket groups in one
/// name give every combination ("a[1-2]-b[3,5]" -> a1-b3 a1-b5 a2-b3 a2-b5). Malformed lists
/// (unbalanced or nested brackets, empty names or ranges, a range that runs backwards) are a
/// ddp::error(errc::config) quoting the list.
std::vector<std::string> expand_nodelist(std::string_view list);

// Parsing is compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
namespace detail {

[[noreturn]] DDP_COMPILED_INLINE void config_error(std::string message) { throw error(errc::config, std::move(message)); }

DDP_COMPILED_INLINE int env_int(std::string_view name, const char* text, int min_value, std::string_view example) {
  const std::string expected = std::string(min_value > 0 ? "a positive integer" : "a non-negative integer") +
                               ", e.g. " + std::string(name) + "=" + std::string(example);
  const auto v = parse_int64(text);
  if (!v) config_error(std::string(name) + "='" + text + "' is not an integer (expected " + expected + ")");
  if (*v < min_value) {
    config_error(std::string(name) + "=" + text + " is " + (*v == 0 ? "zero" : "negative") + " (expected " + expected + ")");
  }
  if (*v > 1'000'000'000) config_error(std::string(name) + "=" + text + " is too large (expected " + expected + ")");
  return static_cast<int>(*v);
}

DDP_COMPILED_INLINE int parse_port(std::string_view name, const char* text) {
  const auto v = parse_int64(text);
  if (!v) config_error(std::string(name) + "='" + text + "' is not a port number (expected an integer 1-65535, e.g. " + std::string(name) + "=29500)");
  if (*v < 1 || *v > 65535) config_error(std::string(name) + "=" + text + " is out of range (expected 1-65535)");
  return static_cast<int>(*v);
}

// Below 32768, where Linux's ephemeral ports start by default: there, an outgoing connection of
// any process on the host could hold a job's port.
inline constexpr int derived_port_first = 20000;
inline constexpr int derived_port_count = 12768;

DDP_COMPILED_INLINE int port_from_job_id(std::string_view job_id) noexcept {
  constexpr auto range = static_cast<std::uint64_t>(derived_port_count);
  std::string_view id = job_id;
  if (const auto colon = id.find(':'); colon != std::string_view::npos) id.remove_prefix(colon + 1);
  const auto dot = id.find('.');
  const std::string_view job = id.substr(0, dot);
  const std::string_view step = dot == std::string_view::npos ? std::string_view("0") : id.substr(dot + 1);
  std::uint64_t n = 0;
  if (all_digits(job) && all_digits(step) && job.size() <= 18 && step.size() <= 18) {
    n = static_cast<std::uint64_t>(*parse_int64(job)) % range + static_cast<std::uint64_t>(*parse_int64(step)) % range * 7919;
  } else {
    n = 14695981039346656037ull;  // FNV-1a, 64 bits
    for (const char c : job_id) n = (n ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  }
  return derived_port_first + static_cast<int>(n % range);
}

DDP_COMPILED_INLINE std::vector<int> derived_port_alternates(int port) {
  std::vector<int> ports;
  for (int k = 1; k <= 7; ++k) ports.push_back(derived_port_first + (port - derived_port_first + k * 4099) % derived_port_count);
  return ports;
}

DDP_COMPILED_INLINE std::vector<int> expand_tasks_per_node(std::string_view name, std::string_view text) {
  const auto bad = [&](std::string_view why) -> std::vector<int> {
    config_error(std::string(name) + "='" + std::string(text) + "' " + std::string(why) +
                 " (expected counts like '4' or '2(x3),1')");
  };
  std::vector<int> out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t comma = std::min(text.find(',', pos), text.size());
    std::string_view item = text.substr(pos, comma - pos);
    std::string_view count = item;
    std::int64_t repeat = 1;
    if (const auto paren = item.find('('); paren != std::string_view::npos) {
      count = item.substr(0, paren);
      std::string_view rest = item.substr(paren + 1);
      if (rest.size() < 3 || rest.front() != 'x' || rest.back() != ')') return bad("is malformed");
      const auto r = parse_int64(rest.substr(1, rest.size() - 2));
      if (!r || *r < 1 || *r > 1'000'000) return bad("has a bad repeat count");
      repeat = *r;
    }
    const auto c = parse_int64(count);
    if (!c || *c < 1 || *c > 1'000'000) return bad("is malformed");
    if (out.size() + static_cast<std::size_t>(repeat) > 1'000'000) return bad("names too many nodes");
    out.insert(out.end(), static_cast<std::size_t>(repeat), static_cast<int>(*c));
    pos = comma + 1;
  }
  return out;
}

}  // namespace detail

DDP_COMPILED_INLINE std::vector<std::string> expand_nodelist(std::string_view list) {
  constexpr std::size_t max_hosts = 1'000'000;
  const auto bad = [&](std::string_view why) -> std::vector<std::string> {
    detail::config_error("node list '" + std::string(list) + "' " + std::string(why) +
                         " (expected host names and bracket ranges, e.g. node[01-03,7],gpu5)");
  };
  std::vector<std::string> hosts;
  std::size_t pos = 0;
  if (list.empty()) return bad("is empty");
  while (pos <= list.size()) {
    // One host expression runs to the next comma outside brackets.
    std::size_t end = pos;
    int depth = 0;
    while (end < list.size() && (depth > 0 || list[end] != ',')) {
      if (list[end] == '[') {
        if (++depth > 1) return bad("has nested brackets");
      } else if (list[end] == ']') {
        if (--depth < 0) return bad("has a ']' without '['");
      }
      ++end;
    }
    if (depth != 0) return bad("has a '[' without ']'");
    const std::string_view expr = list.substr(pos, end - pos);
    if (expr.empty()) return bad("has an empty host name");

    std::vector<std::string> names{""};  // partial expansions of expr so far
    std::size_t i = 0;
    while (i < expr.size()) {
      if (expr[i] != '[') {
        const std::size_t next = std::min(expr.find('[', i), expr.size());
        for (auto& n : names) n.append(expr.substr(i, next - i));
        i = next;
        continue;
      }
      const std::size_t close = expr.find(']', i);
      const std::string_view ranges = expr.substr(i + 1, close - i - 1);
      if (ranges.empty()) return bad("has an empty range '[]'");
      std::vector<std::string> suffixes;
      std::size_t r = 0;
      while (r <= ranges.size()) {
        const std::size_t comma = std::min(ranges.find(',', r), ranges.size());
        const std::string_view range = ranges.substr(r, comma - r);
        const std::size_t dash = range.find('-');
        const std::string_view lo = range.substr(0, dash);
        const std::string_view hi = dash == std::string_view::npos ? lo : range.substr(dash + 1);
        if (!detail::all_digits(lo) || !detail::all_digits(hi) || lo.size() > 18 || hi.size() > 18) {
          return bad("has a bad range '" + std::string(range) + "'");
        }
        const std::int64_t a = *detail::parse_int64(lo);
        const std::int64_t b = *detail::parse_int64(hi);
        if (b < a) return bad("has a range that runs backwards '" + std::string(range) + "'");
        if (static_cast<std::uint64_t>(b - a) >= max_hosts || suffixes.size() + static_cast<std::size_t>(b - a) >= max_hosts) {
          return bad("names too many hosts");
        }
        for (std::int64_t v = a; v <= b; ++v) {
          std::string digits = std::to_string(v);
          if (digits.size() < lo.size()) digits.insert(0, lo.size() - digits.size(), '0');
          suffixes.push_back(std::move(digits));
        }
        r = comma + 1;
      }
      if (names.size() * suffixes.size() + hosts.size() > max_hosts) return bad("names too many hosts");
      std::vector<std::string> product;
      product.reserve(names.size() * suffixes.size());
      for (const auto& n : names)
        for (const auto& s : suffixes) product.push_back(n + s);
      names = std::move(product);
      i = close + 1;
    }
    for (auto& n : names) hosts.push_back(std::move(n));
    pos = end + 1;
  }
  return hosts;
}

#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp
