#pragma once
// Little-endian integer encoding for the store's on-disk records and wire frames: fixed byte
// order so that a file or a connection means the same on every host.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace ddp::store::detail {

template <class T>
inline void put_le(std::vector<std::byte>& out, T value) {
  using U = std::make_unsigned_t<T>;
  auto u = static_cast<U>(value);
  for (std::size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<std::byte>((u >> (8 * i)) & 0xffu));
}

/// Reads sizeof(T) bytes at `at`; the caller has checked the length.
template <class T>
inline T get_le(const std::byte* at) noexcept {
  using U = std::make_unsigned_t<T>;
  U u = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) u = static_cast<U>(u | (static_cast<U>(std::to_integer<unsigned>(at[i])) << (8 * i)));
  return static_cast<T>(u);
}

inline void put_bytes(std::vector<std::byte>& out, std::span<const std::byte> bytes) {
  out.insert(out.end(), bytes.begin(), bytes.end());
}
inline void put_bytes(std::vector<std::byte>& out, std::string_view text) {
  put_bytes(out, std::as_bytes(std::span(text.data(), text.size())));
}

inline std::string to_string(std::span<const std::byte> bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

/// "'a', 'b'": the keys named in timeout messages.
inline std::string quote_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "'" : ", '") + k + "'";
  return out;
}

}  // namespace ddp::store::detail
