#pragma once
// ddp::detail::bulk_copy: memcpy for the data path's large copies (a user's buffer into or out of
// shared memory, gradients into a bucket), without the C library's one slow case.
//
// glibc copies mid-sized blocks with `rep movsb`, which on some x86 cores (AMD's with FSRM among
// them) crawls when the destination lies 1 to 31 bytes past the source modulo a page: from an
// L2-resident source many times slower than at any other distance (bench/README.md, "The slow
// copy distance"). That distance is the common case here, not a rarity: a large std::vector starts
// 16 bytes into its page (the allocator's header), and staging areas and shared buffers start on a
// page, so every copy out of them into such a vector hits it. At those distances this copies with
// 16-byte vectors from the end down, the direction in which a store never lies just ahead of the
// next load in page offset; at every other distance (where `rep movsb` beats such a loop), and
// off x86, it is memcpy. Like memcpy, the two ranges must not overlap.

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ddp::detail {

#if defined(__SSE2__)
// The copy at those distances, out of line: every call site of bulk_copy keeps only the test.
#if defined(__GNUC__) || defined(__clang__)
[[gnu::noinline]]
#endif
inline void copy_down_by_vectors(void* dst, const void* src, std::size_t bytes) noexcept {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  // The last bytes past the destination's last 16-byte boundary first, so that every vector store
  // is aligned (a store split across two cache lines costs more than a split load).
  const std::size_t ragged = (reinterpret_cast<std::uintptr_t>(d) + bytes) % 16;
  std::size_t end = bytes - ragged;
  std::memcpy(d + end, s + end, ragged);
  for (; end >= 64; end -= 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + end - 64));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + end - 48));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + end - 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + end - 16));
    _mm_store_si128(reinterpret_cast<__m128i*>(d + end - 64), a);
    _mm_store_si128(reinterpret_cast<__m128i*>(d + end - 48), b);
    _mm_store_si128(reinterpret_cast<__m128i*>(d + end - 32), c);
    _mm_store_si128(reinterpret_cast<__m128i*>(d + end - 16), e);
  }
  std::memcpy(d, s, end);  // the first bytes, fewer than 64: below the slow case's sizes
}
#endif

inline void bulk_copy(void* dst, const void* src, std::size_t bytes) noexcept {
#if defined(__SSE2__)
  // Below this the C library copies with vector loops at every distance.
  constexpr std::size_t slow_case_from = 2048;
  const std::size_t distance = (reinterpret_cast<std::uintptr_t>(dst) - reinterpret_cast<std::uintptr_t>(src)) % 4096;
  if (bytes >= slow_case_from && distance != 0 && distance < 32) return copy_down_by_vectors(dst, src, bytes);
#endif
  std::memcpy(dst, src, bytes);
}

}  // namespace ddp::detail
