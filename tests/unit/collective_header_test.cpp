// wire_header: the 32-byte little-endian wire form of a collective call, written out by hand from
// the documented layout (magic "CPDD", op, dtype, reduction, 0, seq, count, root, 0), and the
// checks built on it: matches() (exact bytes of this call) and check_header() (fields that matter).
#include <ddp/core/collective.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_collective_header {

using ddp::collective;
using ddp::collective_desc;
using ddp::wire_header;

collective_desc sample() {
  collective_desc d;
  d.seq = 0x0102030405060708ULL;
  d.op = collective::reduce;
  d.type = ddp::dtype::bfloat16;
  d.reduction = ddp::reduce_kind::max;
  d.root = 3;
  d.count = 0x1122334455ULL;
  return d;
}

TEST_CASE("wire_header: the bytes are the documented little-endian layout") {
  const auto h = wire_header::encode(sample());
  const std::array<unsigned char, 32> expected = {
      0x43, 0x50, 0x44, 0x44,                                            // magic 0x44445043
      static_cast<unsigned char>(collective::reduce),                    // op
      static_cast<unsigned char>(ddp::dtype::bfloat16),                  // dtype
      static_cast<unsigned char>(ddp::reduce_kind::max), 0,              // reduction, reserved
      0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,                    // seq
      0x55, 0x44, 0x33, 0x22, 0x11, 0x00, 0x00, 0x00,                    // count
      0x03, 0x00, 0x00, 0x00,                                            // root
      0x00, 0x00, 0x00, 0x00};                                           // reserved
  for (std::size_t i = 0; i < expected.size(); ++i) {
    INFO("byte " << i);
    CHECK(h.bytes[i] == expected[i]);
  }
  CHECK(h.has_magic());
  CHECK(h.decode() == sample());

  unsigned char out[32];
  std::memset(out, 0xee, sizeof out);
  wire_header::encode_to(sample(), out);
  CHECK(std::memcmp(out, h.bytes, sizeof out) == 0);
}

TEST_CASE("wire_header: a root of -1 travels as 0xffffffff and decodes back") {
  auto d = sample();
  d.op = collective::all_reduce;
  d.root = -1;
  const auto h = wire_header::encode(d);
  for (int i = 24; i < 28; ++i) CHECK(h.bytes[i] == 0xff);
  CHECK(h.decode().root == -1);
  CHECK(wire_header::matches(h.bytes, d));
}

TEST_CASE("wire_header::matches: true only for the exact wire form of the call") {
  const auto d = sample();
  const auto h = wire_header::encode(d);
  CHECK(wire_header::matches(h.bytes, d));

  auto other = d;
  other.seq += 1;
  CHECK_FALSE(wire_header::matches(h.bytes, other));
  other = d;
  other.count ^= 1ULL << 40;
  CHECK_FALSE(wire_header::matches(h.bytes, other));
  other = d;
  other.root = 2;
  CHECK_FALSE(wire_header::matches(h.bytes, other));
  other = d;
  other.op = collective::all_reduce;
  CHECK_FALSE(wire_header::matches(h.bytes, other));
  other = d;
  other.type = ddp::dtype::float16;
  CHECK_FALSE(wire_header::matches(h.bytes, other));
  other = d;
  other.reduction = ddp::reduce_kind::min;
  CHECK_FALSE(wire_header::matches(h.bytes, other));

  for (std::size_t i = 0; i < wire_header::size; ++i) {  // any byte changed, the reserved ones too
    auto changed = h;
    changed.bytes[i] ^= 0x80;
    INFO("byte " << i);
    CHECK_FALSE(wire_header::matches(changed.bytes, d));
  }
}

TEST_CASE("check_header: fields that do not matter for the op are ignored, the others are a mismatch naming both calls") {
  auto mine = sample();
  mine.op = collective::all_reduce;  // no root
  auto theirs = mine;
  theirs.root = 7;
  CHECK_FALSE(wire_header::matches(wire_header::encode(theirs).bytes, mine));
  CHECK_NOTHROW(ddp::check_header(wire_header::encode(theirs), mine, 0, 1));

  theirs = mine;
  theirs.count = 5;
  try {
    ddp::check_header(wire_header::encode(theirs), mine, 0, 1);
    FAIL("no mismatch reported");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::mismatch);
    const std::string what = e.what();
    CHECK(what.find("bfloat16 x " + std::to_string(mine.count)) != std::string::npos);
    CHECK(what.find("bfloat16 x 5") != std::string::npos);
    CHECK(what.find("rank 1") != std::string::npos);
  }

  wire_header garbage;
  std::memset(garbage.bytes, 0x5a, sizeof garbage.bytes);
  try {
    ddp::check_header(garbage, mine, 0, 2);
    FAIL("garbage accepted");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::mismatch);
    CHECK(std::string(e.what()).find("not a ddp collective header") != std::string::npos);
  }
}

}  // namespace ddp_test_collective_header
