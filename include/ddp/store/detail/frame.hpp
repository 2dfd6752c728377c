#pragma once
// The tcp_store wire protocol: encoders for the client and a pure, incremental parser for the
// server (no sockets, no state: a span of bytes in, a verdict out), so it can be fuzzed alone.
//
// All integers are little endian. The client speaks first, and says nothing about itself until
// the server has proven that it knows the token:
//   client hello   magic u32 "DDPS" | version u16 | reserved u16 | client nonce[32]       (40 bytes)
//   server hello   magic u32 | version u16 | flags u16 (bit 0: token required) | server nonce[32] |
//                  server proof[32] | job[64]                                              (136 bytes)
//   client proof   client proof[32] | job[64]                                              (96 bytes)
//   server verdict u8: 1 accepted, 0 refused (and the server closes)
// server proof = HMAC-SHA256(token, "ddp-store-server-v3" | client nonce | server nonce)
// client proof = HMAC-SHA256(token, "ddp-store-client-v3" | server nonce | client nonce)
// (32 zero bytes without a token). A client with a token checks the server's proof, in constant
// time, before it sends its own: a server that does not know the token learns neither the
// client's job nor a proof it could replay elsewhere (the two contexts differ, so a proof cannot
// be reflected either). A server that gets another version answers with a hello of its own
// version, as long as a version-2 server hello, so that a client of either version can name it.
//   request        opcode u8 | key bytes u32 | value bytes u32 | key | value                 (9-byte header)
//     set          key, value = the value
//     get          key, value = timeout_ms u64 (the server answers `timeout` when it passes)
//     add          key, value = delta i64
//     compare_set  key, value = expected bytes u32 | expected | desired
//     wait         no key, value = timeout_ms u64 | count u32 | (key bytes u32 | key) * count
//     erase        key, no value
//     num_keys     no key, no value
//     member       key = the participant this connection speaks for (e.g. "rank 3"), no value
//     leave        no key, no value, no response: the participant is done; its close is orderly
//     depart       key = a participant, value = what happened to it (its launcher saw it end)
//   response       status u8 | payload bytes u32 | payload
//     ok: get/compare_set -> the value; add/num_keys -> i64; erase -> u8 existed; others empty
//     timeout: count u32 | (key bytes u32 | key) * count, the keys still missing
//     invalid_argument: a message
//     departed: a message naming the participant whose connection closed without `leave`
//       (the process died); the answer to every parked get/wait, and to every later one that
//       would park, once a participant has departed
// job: the job identity of the rank or server (launch_environment::job_id), zero-padded; all
// zeros when it has none. A client and a server that both have one and differ belong to two
// jobs that share a port: the client refuses the server before it sends its proof, the server
// closes the client, and neither ever reads or writes a key of the other. Fixed-size fields keep
// each handshake step one read on each side.
// Lengths are checked against the limits as soon as the 9-byte header is in, so a hostile length
// is refused before any payload is buffered.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/store/detail/bytes.hpp"
#include "ddp/store/detail/hmac_sha256.hpp"
#include "ddp/store/store.hpp"

namespace ddp::store::detail {

inline constexpr std::uint32_t protocol_magic = 0x53504444u;  // the bytes "DDPS"
inline constexpr std::uint16_t protocol_version = 4;
inline constexpr std::size_t job_field_bytes = 64;
inline constexpr std::size_t nonce_bytes = 32;
inline constexpr std::size_t proof_bytes = 32;
inline constexpr std::size_t client_hello_bytes = 8 + nonce_bytes;
inline constexpr std::size_t server_hello_bytes = 8 + nonce_bytes + proof_bytes + job_field_bytes;
inline constexpr std::size_t client_proof_bytes = proof_bytes + job_field_bytes;
/// The size of a version-2 server hello: a version notice this long reaches a version-2 client's check.
inline constexpr std::size_t version_notice_bytes = 104;
inline constexpr std::uint16_t flag_token_required = 1;
inline constexpr std::string_view server_auth_context = "ddp-store-server-v3";
inline constexpr std::string_view client_auth_context = "ddp-store-client-v3";

inline constexpr std::size_t request_header_bytes = 9;
inline constexpr std::size_t response_header_bytes = 5;
/// wait() lists many keys in its value; this bounds that list.
inline constexpr std::size_t max_wait_bytes = max_value_bytes;
inline constexpr std::size_t max_response_bytes = max_value_bytes + 16;
/// The largest request frame the parser accepts: a compare_set of two values at the limit.
inline constexpr std::size_t max_request_bytes = request_header_bytes + max_key_bytes + 4 + 2 * max_value_bytes;

enum class opcode : std::uint8_t { set = 1, get, add, compare_set, wait, erase, num_keys, member, leave, depart };
enum class status : std::uint8_t { ok = 0, timeout = 1, invalid_argument = 2, departed = 3 };

inline std::string_view to_string(opcode op) noexcept {
  switch (op) {
    case opcode::set: return "store.set";
    case opcode::get: return "store.get";
    case opcode::add: return "store.add";
    case opcode::compare_set: return "store.compare_set";
    case opcode::wait: return "store.wait";
    case opcode::erase: return "store.erase";
    case opcode::num_keys: return "store.num_keys";
    case opcode::member: return "store.member";
    case opcode::leave: return "store.leave";
    case opcode::depart: return "store.depart";
  }
  return "store.?";
}

struct request {
  opcode op{};
  std::string key;                  // set, get, add, compare_set, erase
  std::vector<std::byte> value;     // set: the value; compare_set: the desired value
  std::vector<std::byte> expected;  // compare_set
  std::int64_t delta = 0;           // add
  std::uint64_t timeout_ms = 0;     // get, wait
  std::vector<std::string> keys;    // wait
};

enum class parse_status { need_more, complete, invalid };

struct parse_result {
  parse_status status = parse_status::need_more;
  std::size_t consumed = 0;  // bytes of the frame, when complete
  std::size_t frame_bytes = 0;  // when need_more with the header in: the whole frame's size
  request req;               // when complete
  std::string reason;        // when invalid: why, for the server's log line
};

// ---- handshake -------------------------------------------------------------------------------

/// A job identity as it travels in a hello: ids longer than the field keep their start and end
/// around a '~', which stays readable and keeps ids that differ anywhere apart in practice.
inline std::string job_field_text(std::string_view job) {
  if (job.size() <= job_field_bytes) return std::string(job);
  constexpr std::size_t head = job_field_bytes / 2 - 1;
  constexpr std::size_t tail = job_field_bytes - head - 1;
  return std::string(job.substr(0, head)) + "~" + std::string(job.substr(job.size() - tail));
}

inline void put_job_field(std::vector<std::byte>& out, std::string_view job) {
  const std::string text = job_field_text(job);
  put_bytes(out, text);
  out.resize(out.size() + (job_field_bytes - text.size()), std::byte{0});
}

/// The job identity in a hello's job field ("" when it has none).
inline std::string get_job_field(std::span<const std::byte> field) {
  std::string text(reinterpret_cast<const char*>(field.data()), std::min(field.size(), job_field_bytes));
  if (const auto nul = text.find('\0'); nul != std::string::npos) text.resize(nul);
  return text;
}

/// Two identities clash when both are known and differ.
inline bool jobs_clash(std::string_view a, std::string_view b) { return !a.empty() && !b.empty() && a != b; }

using nonce = std::array<std::byte, nonce_bytes>;

inline std::vector<std::byte> encode_client_hello(std::span<const std::byte, nonce_bytes> client_nonce,
                                                 std::uint16_t version = protocol_version) {
  std::vector<std::byte> out;
  put_le(out, protocol_magic);
  put_le(out, version);
  put_le(out, std::uint16_t{0});
  put_bytes(out, client_nonce);
  return out;
}

/// Checks a client hello, or as much of one as has arrived (so a stranger is turned away on its
/// first bytes, not after a whole hello's worth); an empty reason means acceptable so far.
inline std::string check_client_hello(std::span<const std::byte> hello) {
  if (hello.size() < 4) return {};
  if (get_le<std::uint32_t>(hello.data()) != protocol_magic) return "bad magic (not a ddp store client)";
  if (hello.size() < 6) return {};
  const auto version = get_le<std::uint16_t>(hello.data() + 4);
  if (version != protocol_version)
    return "protocol version " + std::to_string(version) + ", server speaks " + std::to_string(protocol_version);
  return {};
}

/// HMAC-SHA256(token, context | first | second): the proofs of both sides.
inline digest handshake_proof(std::string_view token, std::string_view context, std::span<const std::byte> first,
                              std::span<const std::byte> second) {
  std::vector<std::byte> msg;
  put_bytes(msg, context);
  put_bytes(msg, first);
  put_bytes(msg, second);
  return hmac_sha256(std::as_bytes(std::span(token.data(), token.size())), msg);
}

/// The server's proof that it knows `token`, bound to this client's nonce ("" token: zeros).
inline digest server_proof(std::string_view token, std::span<const std::byte> client_nonce, std::span<const std::byte> server_nonce) {
  if (token.empty()) return {};
  return handshake_proof(token, server_auth_context, client_nonce, server_nonce);
}

/// The client's proof, bound to this server's nonce ("" token: zeros).
inline digest client_proof(std::string_view token, std::span<const std::byte> server_nonce, std::span<const std::byte> client_nonce) {
  if (token.empty()) return {};
  return handshake_proof(token, client_auth_context, server_nonce, client_nonce);
}

inline std::vector<std::byte> encode_server_hello(bool token_required, std::span<const std::byte, nonce_bytes> server_nonce,
                                                 std::span<const std::byte, proof_bytes> proof, std::string_view job = {}) {
  std::vector<std::byte> out;
  put_le(out, protocol_magic);
  put_le(out, protocol_version);
  put_le(out, static_cast<std::uint16_t>(token_required ? flag_token_required : 0));
  put_bytes(out, server_nonce);
  put_bytes(out, proof);
  put_job_field(out, job);
  return out;
}

/// What a server says to a client of another version before it closes: magic and version, zeros
/// after, as long as a version-2 server hello (whose client reads that much before it checks).
inline std::vector<std::byte> encode_version_notice() {
  std::vector<std::byte> out;
  put_le(out, protocol_magic);
  put_le(out, protocol_version);
  out.resize(version_notice_bytes, std::byte{0});
  return out;
}

inline std::span<const std::byte> server_hello_nonce(std::span<const std::byte> hello) { return hello.subspan(8, nonce_bytes); }
inline std::span<const std::byte> server_hello_proof(std::span<const std::byte> hello) {
  return hello.subspan(8 + nonce_bytes, proof_bytes);
}
inline std::string server_hello_job(std::span<const std::byte> hello) {
  return get_job_field(hello.subspan(8 + nonce_bytes + proof_bytes));
}

inline std::vector<std::byte> encode_client_proof(std::span<const std::byte, proof_bytes> proof, std::string_view job = {}) {
  std::vector<std::byte> out;
  put_bytes(out, proof);
  put_job_field(out, job);
  return out;
}

inline std::string client_proof_job(std::span<const std::byte> message) { return get_job_field(message.subspan(proof_bytes)); }

// ---- requests ------------------------------------------------------------------------------

inline std::vector<std::byte> encode_request(opcode op, std::string_view key, std::span<const std::byte> value) {
  std::vector<std::byte> out;
  out.reserve(request_header_bytes + key.size() + value.size());
  put_le(out, static_cast<std::uint8_t>(op));
  put_le(out, static_cast<std::uint32_t>(key.size()));
  put_le(out, static_cast<std::uint32_t>(value.size()));
  put_bytes(out, key);
  put_bytes(out, value);
  return out;
}

inline std::vector<std::byte> encode_get(std::string_view key, std::uint64_t timeout_ms) {
  std::vector<std::byte> v;
  put_le(v, timeout_ms);
  return encode_request(opcode::get, key, v);
}

inline std::vector<std::byte> encode_add(std::string_view key, std::int64_t delta) {
  std::vector<std::byte> v;
  put_le(v, delta);
  return encode_request(opcode::add, key, v);
}

inline std::vector<std::byte> encode_compare_set(std::string_view key, std::span<const std::byte> expected,
                                                 std::span<const std::byte> desired) {
  std::vector<std::byte> v;
  v.reserve(4 + expected.size() + desired.size());
  put_le(v, static_cast<std::uint32_t>(expected.size()));
  put_bytes(v, expected);
  put_bytes(v, desired);
  return encode_request(opcode::compare_set, key, v);
}

inline std::vector<std::byte> encode_key_list(const std::vector<std::string>& keys) {
  std::vector<std::byte> v;
  put_le(v, static_cast<std::uint32_t>(keys.size()));
  for (const auto& k : keys) {
    put_le(v, static_cast<std::uint32_t>(k.size()));
    put_bytes(v, k);
  }
  return v;
}

inline std::vector<std::byte> encode_wait(const std::vector<std::string>& keys, std::uint64_t timeout_ms) {
  std::vector<std::byte> v;
  put_le(v, timeout_ms);
  put_bytes(v, encode_key_list(keys));
  return encode_request(opcode::wait, {}, v);
}

/// Decodes `count u32 | (len u32 | key)*` filling `keys`; false when malformed.
inline bool decode_key_list(std::span<const std::byte> in, std::vector<std::string>& keys, std::string& reason) {
  if (in.size() < 4) {
    reason = "key list shorter than its count";
    return false;
  }
  const auto count = get_le<std::uint32_t>(in.data());
  std::size_t at = 4;
  if (count > (in.size() - at) / 4) {
    reason = "key list claims " + std::to_string(count) + " keys in " + std::to_string(in.size()) + " bytes";
    return false;
  }
  keys.clear();
  keys.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) {
    if (in.size() - at < 4) {
      reason = "key list truncated";
      return false;
    }
    const auto len = get_le<std::uint32_t>(in.data() + at);
    at += 4;
    if (len == 0 || len > max_key_bytes || len > in.size() - at) {
      reason = "key " + std::to_string(i) + " of the list has a bad length " + std::to_string(len);
      return false;
    }
    keys.emplace_back(reinterpret_cast<const char*>(in.data() + at), len);
    at += len;
  }
  if (at != in.size()) {
    reason = std::to_string(in.size() - at) + " stray bytes after the key list";
    return false;
  }
  return true;
}

/// Parses one request frame at the start of `buf`. Pure: the same bytes always give the same verdict.
inline parse_result parse_request(std::span<const std::byte> buf) {
  parse_result r;
  if (buf.size() < 1) return r;
  const auto raw_op = std::to_integer<std::uint8_t>(buf[0]);
  if (raw_op < static_cast<std::uint8_t>(opcode::set) || raw_op > static_cast<std::uint8_t>(opcode::depart)) {
    r.status = parse_status::invalid;
    r.reason = "unknown opcode " + std::to_string(raw_op);
    return r;
  }
  const auto op = static_cast<opcode>(raw_op);
  if (buf.size() < request_header_bytes) return r;
  const std::size_t klen = get_le<std::uint32_t>(buf.data() + 1);
  const std::size_t vlen = get_le<std::uint32_t>(buf.data() + 5);
  auto invalid = [&](std::string why) {
    r.status = parse_status::invalid;
    r.reason = std::string(to_string(op)) + ": " + std::move(why);
    return r;
  };

  const bool has_key = op != opcode::wait && op != opcode::num_keys && op != opcode::leave;
  if (has_key && (klen == 0 || klen > max_key_bytes))
    return invalid("key of " + std::to_string(klen) + " bytes (must be 1 to " + std::to_string(max_key_bytes) + ")");
  if (!has_key && klen != 0) return invalid("unexpected key of " + std::to_string(klen) + " bytes");
  switch (op) {
    case opcode::set:
    case opcode::depart:
      if (vlen > max_value_bytes)
        return invalid("value of " + std::to_string(vlen) + " bytes exceeds " + std::to_string(max_value_bytes));
      break;
    case opcode::get:
    case opcode::add:
      if (vlen != 8) return invalid("value of " + std::to_string(vlen) + " bytes, expected 8");
      break;
    case opcode::compare_set:
      if (vlen < 4 || vlen > 4 + 2 * max_value_bytes)
        return invalid("value of " + std::to_string(vlen) + " bytes is not an expected/desired pair within the limits");
      break;
    case opcode::wait:
      if (vlen < 12 || vlen > max_wait_bytes) return invalid("key list of " + std::to_string(vlen) + " bytes");
      break;
    case opcode::erase:
    case opcode::num_keys:
    case opcode::member:
    case opcode::leave:
      if (vlen != 0) return invalid("unexpected value of " + std::to_string(vlen) + " bytes");
      break;
  }
  const std::size_t total = request_header_bytes + klen + vlen;
  if (buf.size() < total) {
    r.frame_bytes = total;
    return r;
  }

  const auto* key = buf.data() + request_header_bytes;
  const std::span<const std::byte> value(key + klen, vlen);
  r.req.op = op;
  r.req.key.assign(reinterpret_cast<const char*>(key), klen);
  switch (op) {
    case opcode::set:
    case opcode::depart:
      r.req.value.assign(value.begin(), value.end());
      break;
    case opcode::get:
      r.req.timeout_ms = get_le<std::uint64_t>(value.data());
      break;
    case opcode::add:
      r.req.delta = get_le<std::int64_t>(value.data());
      break;
    case opcode::compare_set: {
      const std::size_t elen = get_le<std::uint32_t>(value.data());
      if (elen > vlen - 4) return invalid("expected value of " + std::to_string(elen) + " bytes overruns the frame");
      if (elen > max_value_bytes || vlen - 4 - elen > max_value_bytes) return invalid("value exceeds the limit");
      r.req.expected.assign(value.begin() + 4, value.begin() + 4 + static_cast<std::ptrdiff_t>(elen));
      r.req.value.assign(value.begin() + 4 + static_cast<std::ptrdiff_t>(elen), value.end());
      break;
    }
    case opcode::wait: {
      r.req.timeout_ms = get_le<std::uint64_t>(value.data());
      std::string why;
      if (!decode_key_list(value.subspan(8), r.req.keys, why)) return invalid(why);
      if (r.req.keys.empty()) return invalid("no keys to wait for");
      break;
    }
    case opcode::erase:
    case opcode::num_keys:
    case opcode::member:
    case opcode::leave:
      break;
  }
  r.status = parse_status::complete;
  r.consumed = total;
  return r;
}

// ---- responses -----------------------------------------------------------------------------

inline std::vector<std::byte> encode_response(status s, std::span<const std::byte> payload) {
  std::vector<std::byte> out;
  out.reserve(response_header_bytes + payload.size());
  put_le(out, static_cast<std::uint8_t>(s));
  put_le(out, static_cast<std::uint32_t>(payload.size()));
  put_bytes(out, payload);
  return out;
}

}  // namespace ddp::store::detail
