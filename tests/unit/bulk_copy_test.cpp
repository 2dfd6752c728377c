// detail::bulk_copy against the bytes it must produce: at every distance between destination and
// source modulo a page (the vector path takes 1-31, memcpy the rest), for lengths around the
// vector path's threshold and its 64-byte steps, into a guarded buffer that must stay untouched
// outside the copied range.
#include <ddp/core/bulk_copy.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ddp_test_bulk_copy {

constexpr std::size_t page = 4096;

// A page-aligned place inside v.
unsigned char* page_aligned(std::vector<unsigned char>& v) {
  const auto at = reinterpret_cast<std::uintptr_t>(v.data());
  return v.data() + (page - at % page) % page;
}

TEST_CASE("bulk_copy copies exactly the source bytes at every page distance and length") {
  const std::size_t lengths[] = {0, 1, 63, 2047, 2048, 2049, 2048 + 63, 4096 + 37};
  constexpr std::size_t guard = 64;
  std::vector<unsigned char> source_memory(6 * page), target_memory(6 * page);
  unsigned char* const source = page_aligned(source_memory) + page;
  unsigned char* const target_page = page_aligned(target_memory) + page;
  for (std::size_t i = 0; i < 4 * page; ++i) source[i] = static_cast<unsigned char>(i * 37 + 11);
  for (const std::size_t src_offset : {std::size_t{0}, std::size_t{16}, std::size_t{1000}}) {
    for (std::size_t distance = 0; distance < page; ++distance) {
      // The destination lies `distance` bytes past the source modulo a page.
      unsigned char* const dst = target_page + (src_offset + distance) % page;
      for (const std::size_t length : lengths) {
        unsigned char* const lo = dst - guard;
        for (std::size_t i = 0; i < length + 2 * guard; ++i) lo[i] = static_cast<unsigned char>(0xA5 ^ i);
        ddp::detail::bulk_copy(dst, source + src_offset, length);
        for (std::size_t i = 0; i < guard; ++i) {
          if (lo[i] != static_cast<unsigned char>(0xA5 ^ i) || dst[length + i] != static_cast<unsigned char>(0xA5 ^ (guard + length + i)))
            FAIL("distance " << distance << ", source offset " << src_offset << ", length " << length << ": a byte outside the copy changed");
        }
        for (std::size_t i = 0; i < length; ++i) {
          if (dst[i] != source[src_offset + i])
            FAIL("distance " << distance << ", source offset " << src_offset << ", length " << length << ": byte " << i << " differs");
        }
      }
    }
  }
}

}  // namespace ddp_test_bulk_copy
