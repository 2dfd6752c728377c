// detail::streaming_copy against std::memcpy: every length up to a few vectors, at every
// destination and source offset within 16 bytes, into a guarded buffer that must stay untouched
// outside the copied range.
#include <ddp/backends/ring/streaming_copy.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace ddp_test_streaming_copy {

TEST_CASE("streaming_copy copies exactly the bytes memcpy copies, at every alignment and length") {
  constexpr std::size_t area = 256, guard = 64;
  std::vector<unsigned char> source(area + 2 * guard);
  for (std::size_t i = 0; i < source.size(); ++i) source[i] = static_cast<unsigned char>(i * 37 + 11);
  for (std::size_t dst_offset = 0; dst_offset < 16; ++dst_offset)
    for (std::size_t src_offset = 0; src_offset < 16; ++src_offset)
      for (std::size_t length = 0; length <= 100; ++length) {
        alignas(64) unsigned char got[area + 2 * guard];
        alignas(64) unsigned char want[area + 2 * guard];
        for (std::size_t i = 0; i < sizeof got; ++i) got[i] = want[i] = static_cast<unsigned char>(0xA5 ^ i);
        ddp::detail::streaming_copy(got + guard + dst_offset, source.data() + guard + src_offset, length);
        std::memcpy(want + guard + dst_offset, source.data() + guard + src_offset, length);
        for (std::size_t i = 0; i < sizeof got; ++i) {
          if (got[i] != want[i]) FAIL("dst offset " << dst_offset << ", src offset " << src_offset << ", length " << length << ": byte " << i << " differs");
        }
      }
}

TEST_CASE("streaming_copy of a large unaligned block") {
  std::vector<std::uint8_t> source((1u << 20) + 3), target((1u << 20) + 40, 0);
  for (std::size_t i = 0; i < source.size(); ++i) source[i] = static_cast<std::uint8_t>(i % 251);
  ddp::detail::streaming_copy(target.data() + 5, source.data() + 1, source.size() - 1);
  for (std::size_t i = 0; i < 5; ++i) REQUIRE(target[i] == 0);
  for (std::size_t i = 0; i + 1 < source.size(); ++i) {
    if (target[5 + i] != source[1 + i]) FAIL("byte " << i << " differs");
  }
  for (std::size_t i = 5 + source.size() - 1; i < target.size(); ++i) REQUIRE(target[i] == 0);
}

}  // namespace ddp_test_streaming_copy
