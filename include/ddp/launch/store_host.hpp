#pragma once
// The launcher's side of the job's store: on one node it serves the store itself, and it tells
// the store which worker ended first, so that every rank waiting there names that rank.

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>

#include "ddp/core/error.hpp"
#include "ddp/launch/options.hpp"
#include "ddp/launch/output.hpp"
#include "ddp/store/tcp_store.hpp"

namespace ddp::detail {

/// On one node the launcher serves the job's store: it outlives any rank (rank 0's death does
/// not take it away), it is bound before any rank starts (no other process can take the port
/// in between), and the launcher tells it which rank ended (see report_departure below).
/// A given port that is taken leaves the store to rank 0, as on several nodes (nullptr): its
/// error names the port's holder, and a job whose programs need no store still runs.
inline std::unique_ptr<store::tcp_store_server> host_store(const launch_options& options, const std::string& addr, bool any_port,
                                                           const std::optional<std::string>& token, const std::string& job_id) {
  try {
    return std::make_unique<store::tcp_store_server>(store::tcp_store_server::options{
        .host = addr,
        .port = static_cast<std::uint16_t>(any_port ? 0 : options.master_port),
        .token = token,
        .log = [&options](const std::string& line) { detail::log_line(options, "store: " + line); },
        .job = job_id,
        .linger = std::chrono::milliseconds(0)});  // it stops after every worker has ended
  } catch (const error& e) {
    if (any_port || e.code() != errc::config) throw;
  }
  return nullptr;
}

/// Tells the job's store at addr:port that `who` ended, with `text` for the waiting ranks'
/// errors to quote (store/detail/server_core.hpp, "Departures"). Bounded: the store's host may
/// be the one that ended.
inline void report_departure(const std::string& addr, int port, const std::optional<std::string>& token,
                             const std::string& job_id, const std::string& who, const std::string& text) {
  try {
    store::tcp_store st({.host = addr, .port = static_cast<std::uint16_t>(port),
                         .timeout = std::chrono::milliseconds(300),
                         .token = token,
                         .job = job_id});
    st.report_departure(who, text);
  } catch (const std::exception&) {  // the store is a courtesy channel: the summary still names the cause
  }
}

}  // namespace ddp::detail
