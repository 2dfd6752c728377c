#pragma once
// The pieces of ddp's checkpoint format that need no process group: CRC-32 (zlib's, so Python's
// zlib.crc32 checks a file), a small JSON reader and writer for index.json and safetensors
// headers, safetensors encoding and decoding, and durable file writes (temporary name, fsync,
// rename, fsync of the directory). ddp/checkpoint.hpp builds save, load and latest on them.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ddp/core/compiled.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#endif

namespace ddp::checkpoint::detail {

// --- CRC-32 (IEEE 802.3, reflected, as zlib) -------------------------------------------------

std::uint32_t crc32(std::span<const std::byte> data, std::uint32_t crc = 0) noexcept;

// --- JSON ------------------------------------------------------------------------------------

/// A parsed JSON value. Numbers keep their text, so integers up to 2^63 stay exact.
struct json {
  enum class kind { null, boolean, number, string, array, object };
  kind type = kind::null;
  bool flag = false;
  std::string text;  // a string's value or a number's text
  std::vector<json> items;  // array elements, or object values (keys in `keys`)
  std::vector<std::string> keys;

  const json* find(std::string_view key) const noexcept {
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (keys[i] == key) return &items[i];
    return nullptr;
  }
  bool is_integer() const noexcept {
    if (type != kind::number || text.empty()) return false;
    for (std::size_t i = 0; i < text.size(); ++i)
      if (!(text[i] >= '0' && text[i] <= '9') && !(i == 0 && text[i] == '-')) return false;
    return true;
  }
  std::int64_t as_int() const {
    if (!is_integer()) throw std::invalid_argument("not an integer");
    return std::strtoll(text.c_str(), nullptr, 10);
  }
};

json parse_json(std::string_view text);

std::string json_quote(std::string_view s);

std::string json_shape(std::span<const std::int64_t> shape);

// --- safetensors ------------------------------------------------------------------------------

/// safetensors' dtype names.
constexpr std::string_view safetensors_dtype(dtype t) noexcept {
  switch (t) {
    case dtype::float32: return "F32";
    case dtype::float64: return "F64";
    case dtype::float16: return "F16";
    case dtype::bfloat16: return "BF16";
    case dtype::int32: return "I32";
    case dtype::int64: return "I64";
    case dtype::uint8: return "U8";
  }
  return "U8";
}

std::optional<dtype> dtype_from_safetensors(std::string_view name) noexcept;

/// One tensor going into a file: its bytes are read where they lie, or, with `fill` set (memory
/// the host cannot read, such as a GPU's), `fill` writes data.size() bytes into their place in
/// the file.
struct tensor_out {
  std::string name;
  dtype type = dtype::float32;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;
  std::function<void(std::span<std::byte>)> fill = {};
};

/// One tensor read from a file: a view into the file's bytes.
struct tensor_in {
  std::string name;
  dtype type = dtype::float32;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;
};

/// A safetensors file: u64 little-endian header length, the JSON header (padded with spaces to
/// 8 bytes, as the reference writer does), the tensors back to back in the header's order.
std::vector<std::byte> encode_safetensors(std::span<const tensor_out> tensors,
                                          std::span<const std::pair<std::string, std::string>> metadata);

struct safetensors_file {
  std::vector<tensor_in> tensors;
  std::vector<std::pair<std::string, std::string>> metadata;
  const tensor_in* find(std::string_view name) const noexcept {
    for (const auto& t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }
};

/// Decodes `bytes` (which must outlive the result); std::invalid_argument says what is wrong.
safetensors_file decode_safetensors(std::span<const std::byte> bytes);

// --- files ------------------------------------------------------------------------------------

std::string errno_text(int e);

void fsync_directory(const std::filesystem::path& dir);

/// Called between the temporary file's fsync and its rename (the test hook of checkpoint.hpp).
using before_rename_hook = void (*)(const std::filesystem::path& final_path);

/// Writes `bytes` to path durably: to a temporary name in the same directory, fsync, rename over
/// path, fsync of the directory. A crash leaves either the old file (or none) or the whole new
/// one, never a torn one under the final name.
void write_file_atomically(const std::filesystem::path& path, std::span<const std::byte> bytes,
                           before_rename_hook hook = nullptr);

/// The whole file, or nullopt when it cannot be opened.
std::optional<std::vector<std::byte>> read_file(const std::filesystem::path& path);

inline std::span<const std::byte> as_bytes(std::string_view s) noexcept {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
// Slicing-by-8 (eight tables, eight bytes per round): a checkpoint's CRC runs over every byte
// saved and loaded, and one table lookup per byte made it slower than the disk.
DDP_COMPILED_INLINE std::uint32_t crc32(std::span<const std::byte> data, std::uint32_t crc) noexcept {
  static const auto tables = [] {
    std::array<std::array<std::uint32_t, 256>, 8> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1U) ? 0xedb88320U ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (std::uint32_t i = 0; i < 256; ++i)
      for (std::size_t k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xffU];
    return t;
  }();
  const auto byte = [&](std::size_t i) { return std::to_integer<std::uint32_t>(data[i]); };
  crc = ~crc;
  std::size_t i = 0;
  for (; i + 8 <= data.size(); i += 8) {
    const std::uint32_t lo = crc ^ (byte(i) | byte(i + 1) << 8 | byte(i + 2) << 16 | byte(i + 3) << 24);
    crc = tables[7][lo & 0xffU] ^ tables[6][(lo >> 8) & 0xffU] ^ tables[5][(lo >> 16) & 0xffU] ^ tables[4][lo >> 24] ^
          tables[3][byte(i + 4)] ^ tables[2][byte(i + 5)] ^ tables[1][byte(i + 6)] ^ tables[0][byte(i + 7)];
  }
  for (; i < data.size(); ++i) crc = tables[0][(crc ^ byte(i)) & 0xffU] ^ (crc >> 8);
  return ~crc;
}

class json_parser {
 public:
  explicit json_parser(std::string_view in) : in_(in) {}

  /// The whole input as one value; std::invalid_argument with the offset on bad input.
  json parse() {
    json v = value(0);
    skip_space();
    if (at_ != in_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    throw std::invalid_argument(std::string("invalid JSON at offset ") + std::to_string(at_) + ": " + what);
  }
  void skip_space() {
    while (at_ < in_.size() && (in_[at_] == ' ' || in_[at_] == '\n' || in_[at_] == '\r' || in_[at_] == '\t')) ++at_;
  }
  bool eat(char c) {
    skip_space();
    if (at_ < in_.size() && in_[at_] == c) {
      ++at_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail("unexpected character");
  }
  bool literal(std::string_view word) {
    if (in_.substr(at_, word.size()) != word) return false;
    at_ += word.size();
    return true;
  }

  json value(int depth) {
    // Bounded nesting: a corrupted file must not overflow the stack.
    if (depth > 64) fail("nested too deeply");
    skip_space();
    if (at_ >= in_.size()) fail("unexpected end");
    json v;
    const char c = in_[at_];
    if (c == '{') {
      ++at_;
      v.type = json::kind::object;
      if (eat('}')) return v;
      do {
        skip_space();
        v.keys.push_back(string());
        expect(':');
        v.items.push_back(value(depth + 1));
      } while (eat(','));
      expect('}');
    } else if (c == '[') {
      ++at_;
      v.type = json::kind::array;
      if (eat(']')) return v;
      do v.items.push_back(value(depth + 1));
      while (eat(','));
      expect(']');
    } else if (c == '"') {
      v.type = json::kind::string;
      v.text = string();
    } else if (literal("true")) {
      v.type = json::kind::boolean;
      v.flag = true;
    } else if (literal("false")) {
      v.type = json::kind::boolean;
    } else if (literal("null")) {
      v.type = json::kind::null;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.type = json::kind::number;
      const std::size_t start = at_;
      while (at_ < in_.size() && std::strchr("+-0123456789.eE", in_[at_]) != nullptr) ++at_;
      v.text = std::string(in_.substr(start, at_ - start));
    } else {
      fail("unexpected character");
    }
    return v;
  }

  std::string string() {
    if (at_ >= in_.size() || in_[at_] != '"') fail("expected a string");
    ++at_;
    std::string out;
    while (true) {
      if (at_ >= in_.size()) fail("unterminated string");
      const char c = in_[at_++];
      if (c == '"') return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_ >= in_.size()) fail("unterminated escape");
      const char e = in_[at_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          if (at_ + 4 > in_.size()) fail("short \\u escape");
          const unsigned long cp = std::strtoul(std::string(in_.substr(at_, 4)).c_str(), nullptr, 16);
          at_ += 4;
          // Basic plane only: ddp writes \u escapes for control characters alone.
          if (cp < 0x80) {
            out += static_cast<char>(cp);
          } else if (cp < 0x800) {
            out += static_cast<char>(0xc0 | (cp >> 6));
            out += static_cast<char>(0x80 | (cp & 0x3f));
          } else {
            out += static_cast<char>(0xe0 | (cp >> 12));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
            out += static_cast<char>(0x80 | (cp & 0x3f));
          }
          break;
        }
        default: fail("bad escape");
      }
    }
  }

  std::string_view in_;
  std::size_t at_ = 0;
};

DDP_COMPILED_INLINE json parse_json(std::string_view text) { return json_parser(text).parse(); }

DDP_COMPILED_INLINE std::string json_quote(std::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
      out += b;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

DDP_COMPILED_INLINE std::string json_shape(std::span<const std::int64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

DDP_COMPILED_INLINE std::optional<dtype> dtype_from_safetensors(std::string_view name) noexcept {
  for (const dtype t : {dtype::float32, dtype::float64, dtype::float16, dtype::bfloat16, dtype::int32, dtype::int64,
                        dtype::uint8})
    if (safetensors_dtype(t) == name) return t;
  return std::nullopt;
}

DDP_COMPILED_INLINE std::vector<std::byte> encode_safetensors(std::span<const tensor_out> tensors,
                                                              std::span<const std::pair<std::string, std::string>> metadata) {
  std::string header = "{";
  bool first = true;
  if (!metadata.empty()) {
    header += "\"__metadata__\": {";
    for (std::size_t i = 0; i < metadata.size(); ++i)
      header += (i ? ", " : "") + json_quote(metadata[i].first) + ": " + json_quote(metadata[i].second);
    header += "}";
    first = false;
  }
  std::size_t offset = 0;
  for (const auto& t : tensors) {
    header += (first ? "" : ", ") + json_quote(t.name) + ": {\"dtype\": \"" + std::string(safetensors_dtype(t.type)) +
              "\", \"shape\": " + json_shape(t.shape) + ", \"data_offsets\": [" + std::to_string(offset) + ", " +
              std::to_string(offset + t.data.size()) + "]}";
    offset += t.data.size();
    first = false;
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';
  std::vector<std::byte> out;
  out.reserve(8 + header.size() + offset);
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::byte>((n >> (8 * i)) & 0xffU));
  const auto* h = reinterpret_cast<const std::byte*>(header.data());
  out.insert(out.end(), h, h + header.size());
  for (const auto& t : tensors) {
    if (!t.fill) {
      out.insert(out.end(), t.data.begin(), t.data.end());
      continue;
    }
    const std::size_t at = out.size();
    out.resize(at + t.data.size());
    t.fill(std::span<std::byte>(out).subspan(at));
  }
  return out;
}

DDP_COMPILED_INLINE safetensors_file decode_safetensors(std::span<const std::byte> bytes) {
  if (bytes.size() < 8) throw std::invalid_argument("shorter than the 8-byte header length");
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= std::uint64_t{std::to_integer<std::uint8_t>(bytes[static_cast<std::size_t>(i)])} << (8 * i);
  if (n > bytes.size() - 8) throw std::invalid_argument("header length " + std::to_string(n) + " exceeds the file");
  const std::string_view text(reinterpret_cast<const char*>(bytes.data() + 8), static_cast<std::size_t>(n));
  const json header = parse_json(text);
  if (header.type != json::kind::object) throw std::invalid_argument("header is not a JSON object");
  const auto data = bytes.subspan(8 + static_cast<std::size_t>(n));
  safetensors_file out;
  for (std::size_t i = 0; i < header.keys.size(); ++i) {
    const json& v = header.items[i];
    if (header.keys[i] == "__metadata__") {
      for (std::size_t k = 0; k < v.keys.size(); ++k) out.metadata.emplace_back(v.keys[k], v.items[k].text);
      continue;
    }
    const json* type = v.find("dtype");
    const json* shape = v.find("shape");
    const json* offsets = v.find("data_offsets");
    if (type == nullptr || shape == nullptr || offsets == nullptr || offsets->items.size() != 2)
      throw std::invalid_argument("tensor '" + header.keys[i] + "': dtype, shape or data_offsets missing");
    const auto t = dtype_from_safetensors(type->text);
    if (!t) throw std::invalid_argument("tensor '" + header.keys[i] + "': unsupported dtype " + type->text);
    tensor_in ti{.name = header.keys[i], .type = *t, .shape = {}, .data = {}};
    std::int64_t numel = 1;
    for (const auto& d : shape->items) {
      ti.shape.push_back(d.as_int());
      numel *= ti.shape.back();
    }
    const auto begin = offsets->items[0].as_int(), end = offsets->items[1].as_int();
    if (begin < 0 || end < begin || static_cast<std::uint64_t>(end) > data.size() ||
        end - begin != numel * static_cast<std::int64_t>(size_of(*t)))
      throw std::invalid_argument("tensor '" + header.keys[i] + "': data_offsets do not fit its shape or the file");
    ti.data = data.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(end - begin));
    out.tensors.push_back(std::move(ti));
  }
  return out;
}

DDP_COMPILED_INLINE std::string errno_text(int e) { return std::strerror(e); }

DDP_COMPILED_INLINE void fsync_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw error(errc::internal, "checkpoint: cannot open directory '" + dir.string() + "': " + errno_text(errno));
  const int rc = ::fsync(fd);
  const int e = errno;
  ::close(fd);
  if (rc != 0) throw error(errc::internal, "checkpoint: fsync of '" + dir.string() + "' failed: " + errno_text(e));
}

DDP_COMPILED_INLINE void write_file_atomically(const std::filesystem::path& path, std::span<const std::byte> bytes,
                                               before_rename_hook hook) {
  const std::filesystem::path tmp = path.string() + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw error(errc::internal, "checkpoint: cannot create '" + tmp.string() + "': " + errno_text(errno));
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int e = errno;
      ::close(fd);
      throw error(errc::internal, "checkpoint: writing '" + tmp.string() + "' failed: " + errno_text(e));
    }
    done += static_cast<std::size_t>(w);
  }
  if (::fsync(fd) != 0) {
    const int e = errno;
    ::close(fd);
    throw error(errc::internal, "checkpoint: fsync of '" + tmp.string() + "' failed: " + errno_text(e));
  }
  ::close(fd);
  if (hook != nullptr) hook(path);
  if (::rename(tmp.c_str(), path.c_str()) != 0)
    throw error(errc::internal, "checkpoint: rename to '" + path.string() + "' failed: " + errno_text(errno));
  fsync_directory(path.parent_path());
}

DDP_COMPILED_INLINE std::optional<std::vector<std::byte>> read_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::vector<std::byte> out;
  std::byte buf[1 << 16];
  while (true) {
    const ssize_t r = ::read(fd, buf, sizeof buf);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      ::close(fd);
      return std::nullopt;
    }
    if (r == 0) break;
    out.insert(out.end(), buf, buf + r);
  }
  ::close(fd);
  return out;
}
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp::checkpoint::detail
