#pragma once
// streaming_copy: memcpy with non-temporal stores, for a copy into shared memory whose lines
// another core read since they were last written here (a staging chunk a peer reduced from). An
// ordinary store must first take each such line back from the reader's cache (a read for ownership
// per line); a streaming store writes the whole line without reading it. Where the reader's copies
// are likely still cached, that is the cheaper way; where they have long been evicted, ordinary
// stores win (they leave the data in cache for the reader), so callers choose by size, and by
// measurement where the cores' placement decides (staging_copy_choice.hpp). The copy ends with a
// store fence: streaming stores are not ordered by a later release store, and the caller's release
// store is what tells the reader the data is there.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "ddp/backends/ring/elementwise.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ddp::detail {

DDP_HOT_KERNEL inline void streaming_copy(void* dst, const void* src, std::size_t bytes) noexcept {
#if defined(__SSE2__)
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  // Up to the first 16-byte boundary of the destination, and the ragged end: ordinary stores.
  const std::size_t head = std::min(bytes, (16 - reinterpret_cast<std::uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  const std::size_t vectors = bytes / 16;
  for (std::size_t i = 0; i < vectors; ++i) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d) + i, _mm_loadu_si128(reinterpret_cast<const __m128i*>(s) + i));
  }
  std::memcpy(d + vectors * 16, s + vectors * 16, bytes - vectors * 16);
  _mm_sfence();
#else
  std::memcpy(dst, src, bytes);
#endif
}

}  // namespace ddp::detail
