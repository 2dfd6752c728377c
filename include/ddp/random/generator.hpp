#pragma once
// ddp::torch_generator: PyTorch's CPU generator (CPUGeneratorImpl), reproduced bit for bit.
//
// Matches torch 2.15 (and every release since the mt19937 engine of 1.x): the engine is the
// standard 32-bit MT19937 seeded with init_genrand(seed mod 2^32), random() is one tempered
// word, random64() is (w0 << 32) | w1. torch.manual_seed(s) seeds the default generator exactly
// like torch.Generator().manual_seed(s), so either is reproduced by torch_generator{s}.
// The generator also holds torch's cached second Box-Muller samples (double and float); seeding
// clears them. Distributions on top of it live in random/distributions.hpp.

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ddp/core/error.hpp"

namespace ddp {

/// Everything that determines a torch_generator's future output, like torch's get_state():
/// the full seed (only its low 32 bits reach the engine), the mt19937 words, the read position,
/// and the cached normal samples.
struct torch_generator_state {
  static constexpr std::size_t words = 624;
  std::uint64_t seed = 0;
  std::array<std::uint32_t, words> mt{};
  int left = 1;    // torch's MT19937 counts down to the next twist; 1 right after seeding
  int next = 0;    // index of the next word to temper
  std::optional<double> next_double_normal;
  std::optional<float> next_float_normal;

  friend bool operator==(const torch_generator_state&, const torch_generator_state&) = default;
};

class torch_generator {
 public:
  /// torch's default_rng_seed_val: what a fresh torch.Generator() starts from.
  static constexpr std::uint64_t default_seed = 67280421310721ULL;

  torch_generator() noexcept : torch_generator(default_seed) {}
  explicit torch_generator(std::uint64_t seed) noexcept { manual_seed(seed); }

  /// torch.Generator.manual_seed / torch.manual_seed: reseeds and drops the cached normals.
  torch_generator& manual_seed(std::uint64_t seed) noexcept {
    s_.seed = seed;
    s_.mt[0] = static_cast<std::uint32_t>(seed & 0xffffffffULL);
    for (std::size_t j = 1; j < torch_generator_state::words; ++j) {
      const std::uint32_t prev = s_.mt[j - 1];
      s_.mt[j] = 1812433253U * (prev ^ (prev >> 30)) + static_cast<std::uint32_t>(j);
    }
    s_.left = 1;
    s_.next = 0;
    s_.next_double_normal.reset();
    s_.next_float_normal.reset();
    return *this;
  }

  /// The seed as given (all 64 bits), like torch.Generator.initial_seed().
  std::uint64_t initial_seed() const noexcept { return s_.seed; }

  /// One tempered mt19937 output.
  std::uint32_t random() noexcept {
    if (--s_.left == 0) twist();
    std::uint32_t y = s_.mt[static_cast<std::size_t>(s_.next++)];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680U;
    y ^= (y << 15) & 0xefc60000U;
    y ^= y >> 18;
    return y;
  }

  /// Two outputs, the first one in the high half (torch's make64BitsFrom32Bits).
  std::uint64_t random64() noexcept {
    const std::uint64_t hi = random();
    const std::uint64_t lo = random();
    return (hi << 32) | lo;
  }

  /// The cached r*sin(theta) of the double Box-Muller pair (randn with fewer than 16 values).
  std::optional<double> next_double_normal_sample() const noexcept { return s_.next_double_normal; }
  void set_next_double_normal_sample(std::optional<double> v) noexcept { s_.next_double_normal = v; }
  std::optional<float> next_float_normal_sample() const noexcept { return s_.next_float_normal; }
  void set_next_float_normal_sample(std::optional<float> v) noexcept { s_.next_float_normal = v; }

  const torch_generator_state& state() const noexcept { return s_; }
  void set_state(const torch_generator_state& state) noexcept { s_ = state; }

  /// Skips `n` 32-bit words, e.g. to account for a draw made elsewhere (DataLoader's base seed).
  void discard(std::uint64_t n) noexcept {
    for (; n > 0; --n) (void)random();
  }

  friend bool operator==(const torch_generator&, const torch_generator&) = default;

 private:
  static constexpr std::size_t n_words = torch_generator_state::words;
  static constexpr std::size_t m_words = 397;

  static constexpr std::uint32_t twist_word(std::uint32_t u, std::uint32_t v) noexcept {
    const std::uint32_t mixed = (u & 0x80000000U) | (v & 0x7fffffffU);
    return (mixed >> 1) ^ ((v & 1U) ? 0x9908b0dfU : 0U);
  }

  // Regenerates all 624 words at once, as torch's next_state() does.
  void twist() noexcept {
    auto& mt = s_.mt;
    for (std::size_t k = 0; k < n_words - m_words; ++k) mt[k] = mt[k + m_words] ^ twist_word(mt[k], mt[k + 1]);
    for (std::size_t k = n_words - m_words; k < n_words - 1; ++k)
      mt[k] = mt[k + m_words - n_words] ^ twist_word(mt[k], mt[k + 1]);
    mt[n_words - 1] = mt[m_words - 1] ^ twist_word(mt[n_words - 1], mt[0]);
    s_.left = static_cast<int>(n_words);
    s_.next = 0;
  }

  torch_generator_state s_;
};

/// A torch_generator_state as bytes, for checkpoints: a fixed little-endian layout that does not
/// depend on the host (seed u64, 624 x u32 words, left i32, next i32, then the two cached normals,
/// each as a has-value byte and the value's bits: f64, f32): 2,526 bytes.
inline constexpr std::size_t torch_generator_state_bytes = 8 + 4 * torch_generator_state::words + 4 + 4 + 1 + 8 + 1 + 4;

namespace detail {
inline void rng_put_le(std::vector<std::byte>& out, std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xffU));
}
inline std::uint64_t rng_get_le(std::span<const std::byte> in, std::size_t& at, int n) {
  std::uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= std::uint64_t{std::to_integer<std::uint8_t>(in[at++])} << (8 * i);
  return v;
}
}  // namespace detail

inline std::vector<std::byte> to_bytes(const torch_generator_state& s) {
  std::vector<std::byte> out;
  out.reserve(torch_generator_state_bytes);
  detail::rng_put_le(out, s.seed, 8);
  for (const std::uint32_t w : s.mt) detail::rng_put_le(out, w, 4);
  detail::rng_put_le(out, static_cast<std::uint32_t>(s.left), 4);
  detail::rng_put_le(out, static_cast<std::uint32_t>(s.next), 4);
  detail::rng_put_le(out, s.next_double_normal ? 1 : 0, 1);
  detail::rng_put_le(out, std::bit_cast<std::uint64_t>(s.next_double_normal.value_or(0.0)), 8);
  detail::rng_put_le(out, s.next_float_normal ? 1 : 0, 1);
  detail::rng_put_le(out, std::bit_cast<std::uint32_t>(s.next_float_normal.value_or(0.0f)), 4);
  return out;
}

/// The inverse of to_bytes; errc::invalid_argument when the size or a field is out of range.
inline torch_generator_state torch_generator_state_from_bytes(std::span<const std::byte> in) {
  if (in.size() != torch_generator_state_bytes)
    throw error(errc::invalid_argument, "torch_generator state: expected " + std::to_string(torch_generator_state_bytes) +
                                            " bytes, got " + std::to_string(in.size()));
  torch_generator_state s;
  std::size_t at = 0;
  s.seed = detail::rng_get_le(in, at, 8);
  for (auto& w : s.mt) w = static_cast<std::uint32_t>(detail::rng_get_le(in, at, 4));
  s.left = static_cast<int>(static_cast<std::int32_t>(detail::rng_get_le(in, at, 4)));
  s.next = static_cast<int>(static_cast<std::int32_t>(detail::rng_get_le(in, at, 4)));
  const auto has_double = detail::rng_get_le(in, at, 1);
  const auto double_bits = detail::rng_get_le(in, at, 8);
  const auto has_float = detail::rng_get_le(in, at, 1);
  const auto float_bits = static_cast<std::uint32_t>(detail::rng_get_le(in, at, 4));
  // An out-of-range position would index past the words on the next draw.
  if (s.left < 1 || s.left > static_cast<int>(torch_generator_state::words) || s.next < 0 ||
      s.next > static_cast<int>(torch_generator_state::words) || has_double > 1 || has_float > 1)
    throw error(errc::invalid_argument, "torch_generator state: the bytes do not hold a valid state");
  if (has_double) s.next_double_normal = std::bit_cast<double>(double_bits);
  if (has_float) s.next_float_normal = std::bit_cast<float>(float_bits);
  return s;
}

}  // namespace ddp
