// libFuzzer target over the tcp_store server without sockets (detail::server_core) and its pure
// frame parser (detail::parse_request). Nothing the bytes say may crash the server, corrupt it,
// or make it answer out of protocol.
//
// Input: byte 0 = flags (bit 0: the server has a token; bits 1-2: how many of the 4 virtual
// connections start already authenticated), then commands; command byte c:
//   c & 3 = connection, (c >> 2) & 3 = action:
//     0 receive: next byte n, then n bytes, of which the connection is given as many as
//                input_allowance() lets the socket loop read (all are also parsed alone, see below)
//     1 drain:   next byte b, up to 16*b bytes of the connection's output are "written"
//     2 time:    next byte b, the clock moves 10*b ms and expire() runs
//     3 reopen:  the connection is closed and a fresh one opened
// Parser oracle: a chunk that parses as a complete request re-encodes to exactly the bytes it
// consumed, and every shorter prefix of those bytes needs more.
// tests/fuzz/make_corpus.py writes the seed corpus in this format.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "ddp/store/detail/frame.hpp"
#include "ddp/store/detail/server_core.hpp"

namespace ds = ddp::store::detail;

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

std::vector<std::byte> reencode(const ds::request& r) {
  switch (r.op) {
    case ds::opcode::set:
    case ds::opcode::depart: return ds::encode_request(r.op, r.key, r.value);
    case ds::opcode::get: return ds::encode_get(r.key, r.timeout_ms);
    case ds::opcode::add: return ds::encode_add(r.key, r.delta);
    case ds::opcode::compare_set: return ds::encode_compare_set(r.key, r.expected, r.value);
    case ds::opcode::wait: return ds::encode_wait(r.keys, r.timeout_ms);
    case ds::opcode::erase:
    case ds::opcode::num_keys:
    case ds::opcode::member:
    case ds::opcode::leave: return ds::encode_request(r.op, r.key, {});
  }
  return {};
}

void check_parser(std::span<const std::byte> chunk) {
  const auto r = ds::parse_request(chunk);
  if (r.status != ds::parse_status::complete) return;
  require(r.consumed <= chunk.size());
  const auto again = reencode(r.req);
  require(again.size() == r.consumed && std::equal(again.begin(), again.end(), chunk.begin()));
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, ds::request_header_bytes, r.consumed - 1})
    if (n < r.consumed) require(ds::parse_request(chunk.first(n)).status == ds::parse_status::need_more);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const auto* in = reinterpret_cast<const std::byte*>(data);
  const bool with_token = (data[0] & 1) != 0;
  const int pre_authenticated = (data[0] >> 1) & 3;
  const std::string token = "fuzz-token";
  ds::server_core core({.token = with_token ? token : std::string(), .job = "fuzz-job",
                        .handshake_timeout = std::chrono::milliseconds(500), .log = {}});
  auto now = ddp::clock::time_point{} + std::chrono::hours(1);

  std::uint64_t ids[4];
  std::uint64_t next_id = 1;
  auto open = [&](int slot) {
    ids[slot] = next_id++;
    std::array<std::byte, ds::nonce_bytes> nonce{};
    nonce[0] = static_cast<std::byte>(ids[slot]);
    core.open(ids[slot], "fuzz:" + std::to_string(slot), nonce, now);
    if (slot < pre_authenticated) {
      ds::nonce mine{};
      mine[1] = static_cast<std::byte>(ids[slot]);
      core.receive(ids[slot], ds::encode_client_hello(mine), now);
      const auto hello = core.output(ids[slot]);
      require(hello.size() == ds::server_hello_bytes);
      // The server proves the token (when it has one) before the client says anything more.
      const auto expected = ds::server_proof(with_token ? token : std::string(), mine, nonce);
      require(ds::constant_time_equal(ds::server_hello_proof(hello), expected));
      const auto proof = ds::client_proof(with_token ? token : std::string(), ds::server_hello_nonce(hello), mine);
      core.sent(ids[slot], hello.size(), now);
      core.receive(ids[slot], ds::encode_client_proof(proof, "fuzz-job"), now);
      require(!core.closing(ids[slot]));
      const auto out = core.output(ids[slot]);  // the accepted verdict
      require(out.size() == 1 && out.back() == std::byte{1});
      core.sent(ids[slot], out.size(), now);
    }
  };
  for (int i = 0; i < 4; ++i) open(i);

  std::size_t at = 1;
  while (at < size) {
    const std::uint8_t c = data[at++];
    const int slot = c & 3;
    const std::size_t arg = at < size ? data[at++] : 0;
    switch ((c >> 2) & 3) {
      case 0: {
        const std::size_t n = std::min(arg, size - at);
        const std::span<const std::byte> chunk(in + at, n);
        at += n;
        check_parser(chunk);
        // As the socket loop does: no more than the core allows.
        core.receive(ids[slot], chunk.first(std::min(chunk.size(), core.input_allowance(ids[slot]))), now);
        break;
      }
      case 1: {
        const auto out = core.output(ids[slot]);
        core.sent(ids[slot], std::min(out.size(), arg * 16), now);
        break;
      }
      case 2:
        now += std::chrono::milliseconds(10 * arg);
        core.expire(now);
        break;
      case 3:
        core.close(ids[slot]);
        open(slot);
        break;
    }
    require(core.num_parked() <= core.num_connections());
    require(core.num_connections() <= 4);
    require(core.num_unauthenticated() <= core.num_connections());
    require(core.reserved_bytes() <= ds::server_core::default_frame_budget);
    // Unauthenticated connections hold at most one handshake message in and out.
    require(core.unauthenticated_bytes() <= 4 * 4 * (ds::client_proof_bytes + ds::server_hello_bytes + ds::version_notice_bytes));
  }
  return 0;
}
