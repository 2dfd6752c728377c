#pragma once
// ddp::error: the one exception type of the library.
//
// It carries a code (ddp::errc), the rank that raised it, and the collective and its
// sequence number when there is one, and reads like
//   ddp: rank 0: all_reduce #17 (float32 x 1024, sum): peer rank 1 closed the connection
// errc is registered as a std::error_category so it also works with std::error_code.

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include "ddp/core/compiled.hpp"

namespace ddp {

enum class errc {
  timeout = 1,       // a deadline expired
  peer_lost,         // a peer closed its connection, died, or aborted
  mismatch,          // ranks called different collectives / dtypes / counts / roots
  invalid_argument,  // bad argument to a call
  config,            // bad environment or options, port in use, ...
  store,             // rendezvous store failure (server gone, protocol error, refused)
  unavailable,       // a feature that is not compiled in or not present on this machine
  cuda,
  nccl,
  mpi,
  internal,          // a bug in ddp
};

constexpr std::string_view to_string(errc code) noexcept {
  switch (code) {
    case errc::timeout: return "timeout";
    case errc::peer_lost: return "peer_lost";
    case errc::mismatch: return "mismatch";
    case errc::invalid_argument: return "invalid_argument";
    case errc::config: return "config";
    case errc::store: return "store";
    case errc::unavailable: return "unavailable";
    case errc::cuda: return "cuda";
    case errc::nccl: return "nccl";
    case errc::mpi: return "mpi";
    case errc::internal: return "internal";
  }
  return "unknown";
}

namespace detail {
class errc_category_impl final : public std::error_category {
 public:
  const char* name() const noexcept override { return "ddp"; }
  std::string message(int value) const override { return std::string(to_string(static_cast<errc>(value))); }
};
}  // namespace detail

inline const std::error_category& errc_category() noexcept {
  static const detail::errc_category_impl category;
  return category;
}

inline std::error_code make_error_code(errc code) noexcept { return {static_cast<int>(code), errc_category()}; }

/// Where an error happened: which rank, which collective, which call of it.
/// Every field is optional; what() prints only what is known.
struct error_context {
  int rank = -1;               // -1: not known / not in a group
  std::string op = {};         // e.g. "all_reduce", "store.get"
  std::optional<std::uint64_t> seq = {};  // the collective's sequence number in its group
  std::string detail = {};     // e.g. "float32 x 1024, sum"
  int backend_code = 0;        // native NCCL / MPI / errno code when there is one
};

class error : public std::runtime_error {
 public:
  error(errc code, const std::string& message, error_context context = {})
      : std::runtime_error(format(code, message, context)),
        code_(code),
        message_(message),
        context_(std::move(context)) {}

  errc code() const noexcept { return code_; }
  int rank() const noexcept { return context_.rank; }
  std::string_view op() const noexcept { return context_.op; }
  std::optional<std::uint64_t> seq() const noexcept { return context_.seq; }
  int backend_code() const noexcept { return context_.backend_code; }
  const error_context& context() const noexcept { return context_; }
  /// The cause alone, without the "ddp: rank R: op #N (...)" prefix.
  const std::string& message() const noexcept { return message_; }

  /// The same error seen from another place (e.g. the collective that observed it).
  error with_context(error_context context) const { return error(code_, message_, std::move(context)); }

 private:
  static std::string format(errc code, const std::string& message, const error_context& c);

  errc code_;
  std::string message_;
  error_context context_;
};

/// "what failed: strerror(errno)" for a failed POSIX call; `err` defaults to errno.
std::string system_message(std::string_view what, int err = errno);

// Compiled once with the compiled library (ddp/core/compiled.hpp): every throw site calls these.
#if !DDP_DECLARATIONS_ONLY
DDP_COMPILED_INLINE std::string error::format(errc code, const std::string& message, const error_context& c) {
  (void)code;
  std::string out = "ddp: ";
  if (c.rank >= 0) out += "rank " + std::to_string(c.rank) + ": ";
  if (!c.op.empty()) {
    out += c.op;
    if (c.seq) out += " #" + std::to_string(*c.seq);
    if (!c.detail.empty()) out += " (" + c.detail + ")";
    out += ": ";
  }
  out += message;
  return out;
}

DDP_COMPILED_INLINE std::string system_message(std::string_view what, int err) {
  std::string out(what);
  out += ": ";
  out += std::strerror(err);
  out += " (errno ";
  out += std::to_string(err);
  out += ")";
  return out;
}
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp

template <>
struct std::is_error_code_enum<ddp::errc> : std::true_type {};
