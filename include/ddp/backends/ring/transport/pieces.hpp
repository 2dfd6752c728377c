#pragma once
// Scatter-gather pieces of a byte stream: what vectored transports (tcp_transport::send_recv_v)
// and the algorithms exchange, so a header and its payload travel in one syscall without a copy.

#include <cstddef>
#include <span>

namespace ddp {

using send_piece = std::span<const std::byte>;  // bytes to send, in order
using recv_piece = std::span<std::byte>;        // where received bytes go, in order

}  // namespace ddp
