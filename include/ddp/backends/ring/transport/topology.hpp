#pragma once
// ddp::rank_topology: where every rank of a group runs (host identity, process id, the CPUs it
// may run on), exchanged
// once through the store when the ring backend is set up and handed to every layer that needs
// it: the choice of shared memory, tcp or a hierarchy, the tcp mesh's listen address and spin
// policy, the shared-memory group's one-host check and wait policy, the heartbeat's pidfd watch.
// The CPUs: a launcher that binds each rank to its own CPU (srun --cpu-bind, mpirun --bind-to
// core, Intel MPI's pinning) leaves each process one CPU, yet the ranks of a host do not share
// one: whether they outnumber their CPUs is a question about all of them together. A transport
// built on its own (without a backend) exchanges one itself, the same way.
// A level of the ring backend's hierarchy (a host's shared memory, the hosts' leaders) gets a
// part() of the backend's topology, which carries the numbers its ranks go by in messages.

#include <sched.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ddp/backends/ring/transport/rank_numbering.hpp"
#include "ddp/core/cpus.hpp"
#include "ddp/core/deadline.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/host.hpp"
#include "ddp/store/store.hpp"

namespace ddp {

struct rank_place {
  std::string identity;       // host_identity(): hostname, boot id, namespaces
  std::string layout_identity;  // the host it counts as when ranks are grouped by host (a testing hook may pose; else identity)
  long long pid = 0;
  std::string note;  // what the exchanging layer adds (the ring backend: its hierarchy choice)
  std::string cpus;  // the CPUs the process may run on, e.g. "0-3,8" (sched_getaffinity); empty: unknown

  /// The host name, for messages.
  std::string hostname() const { return identity.substr(0, identity.find(' ')); }
};

class rank_topology {
 public:
  rank_topology() = default;
  rank_topology(int rank, std::vector<rank_place> places) : rank_(rank), places_(std::move(places)) {}

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return static_cast<int>(places_.size()); }
  const rank_place& of(int r) const { return places_.at(static_cast<std::size_t>(r)); }
  const rank_place& mine() const { return of(rank_); }
  const std::vector<rank_place>& places() const noexcept { return places_; }

  /// Whether rank r runs on this rank's host and can share its memory and see its processes.
  bool shares_host_with(int r) const { return of(r).identity == mine().identity; }
  int ranks_on_this_host() const {
    int n = 0;
    for (const auto& p : places_) n += p.identity == mine().identity ? 1 : 0;
    return n;
  }
  /// How many CPUs the ranks on this host may run on together (the union of their CPU sets);
  /// 0 when a rank's set is unknown.
  int cpus_of_this_host() const {
    std::vector<bool> any;
    for (const auto& p : places_) {
      if (p.identity != mine().identity) continue;
      if (!add_cpu_list(p.cpus, any)) return 0;
    }
    int n = 0;
    for (const bool b : any) n += b ? 1 : 0;
    return n;
  }

  /// This process's CPUs as a list of ranges ("0-3,8"); empty when they cannot be read.
  static std::string cpu_list_of_this_process() {
    const std::vector<int> cpus = detail::allowed_cpus();
    std::string out;
    for (std::size_t i = 0; i < cpus.size();) {
      std::size_t last = i;  // the end of a run of consecutive ids
      while (last + 1 < cpus.size() && cpus[last + 1] == cpus[last] + 1) ++last;
      out += (out.empty() ? "" : ",") + std::to_string(cpus[i]) + (last > i ? "-" + std::to_string(cpus[last]) : std::string());
      i = last + 1;
    }
    return out;
  }
  /// Marks the CPUs of a list of ranges in `cpus`; false for an empty or malformed list.
  static bool add_cpu_list(const std::string& list, std::vector<bool>& cpus) {
    if (list.empty()) return false;
    std::size_t at = 0;
    while (at < list.size()) {
      char* end = nullptr;
      const long first = std::strtol(list.c_str() + at, &end, 10);
      long last = first;
      if (end == list.c_str() + at || first < 0 || first >= CPU_SETSIZE) return false;
      if (*end == '-') {
        const char* from = end + 1;
        last = std::strtol(from, &end, 10);
        if (end == from || last < first || last >= CPU_SETSIZE) return false;
      }
      if (*end != ',' && *end != '\0') return false;
      if (cpus.size() <= static_cast<std::size_t>(last)) cpus.resize(static_cast<std::size_t>(last) + 1, false);
      for (long c = first; c <= last; ++c) cpus[static_cast<std::size_t>(c)] = true;
      at = static_cast<std::size_t>(end - list.c_str()) + (*end == ',' ? 1 : 0);
      if (*end == '\0') break;
    }
    return true;
  }

  /// The topology of a sub-group: `members` are ranks of this one, in the sub-group's order;
  /// this rank is sub-group rank `new_rank`.
  rank_topology subset(std::span<const int> members, int new_rank) const {
    std::vector<rank_place> sub;
    sub.reserve(members.size());
    for (int r : members) sub.push_back(of(r));
    return rank_topology(new_rank, std::move(sub));
  }
  /// The topology of a part of this group that works on its behalf (a level of the hierarchy):
  /// as subset(), but its ranks keep the numbers they go by here in messages.
  rank_topology part(std::span<const int> members, int new_rank) const {
    auto sub = subset(members, new_rank);
    std::vector<int> numbers;
    numbers.reserve(members.size());
    for (int r : members) numbers.push_back(numbering_(r));
    sub.numbering_ = rank_numbering(std::move(numbers));
    return sub;
  }
  /// The numbers this group's ranks go by in messages.
  const rank_numbering& numbering() const noexcept { return numbering_; }

  /// Every rank publishes its place under <key_prefix><rank> and reads everyone's. Collective.
  /// `layout_identity` empty: the real identity; `note` travels as it is (no newline).
  static rank_topology exchange(store::store& st, const std::string& key_prefix, int rank, int size, deadline until,
                                const std::string& note = {}, const std::string& layout_identity = {}) {
    if (size <= 1) return rank_topology(rank, {here(note, layout_identity)});
    publish(st, key_prefix, rank, note, layout_identity);
    store::wait_for_ranks(st, size, rank, [&](int r) { return key_prefix + std::to_string(r); }, until.remaining(),
                          "where they run (host identity)");
    return read(st, key_prefix, rank, size);
  }

  /// The two halves of exchange(), for a caller that waits for the keys its own way.
  static void publish(store::store& st, const std::string& key_prefix, int rank, const std::string& note = {},
                      const std::string& layout_identity = {}) {
    const rank_place me = here(note, layout_identity);
    st.set_string(key_prefix + std::to_string(rank),
                  std::to_string(me.pid) + "\n" + me.identity + "\n" + me.layout_identity + "\n" + me.note + "\n" + me.cpus);
  }
  /// Every rank's place, once all have published.
  static rank_topology read(store::store& st, const std::string& key_prefix, int rank, int size) {
    std::vector<rank_place> places;
    places.reserve(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) {
      const std::string key = key_prefix + std::to_string(r);
      places.push_back(parse(st.get_string(key), key, rank));
    }
    return rank_topology(rank, std::move(places));
  }

 private:
  static rank_place here(const std::string& note, const std::string& layout_identity) {
    rank_place me{.identity = host_identity(),
                  .layout_identity = {},
                  .pid = static_cast<long long>(::getpid()),
                  .note = note,
                  .cpus = cpu_list_of_this_process()};
    me.layout_identity = layout_identity.empty() ? me.identity : layout_identity;
    return me;
  }

  static rank_place parse(const std::string& value, const std::string& key, int rank) {
    rank_place p;
    std::size_t at = 0;
    auto field = [&]() -> std::string {
      const auto end = value.find('\n', at);
      if (end == std::string::npos) {
        std::string last = value.substr(at);
        at = value.size() + 1;
        return last;
      }
      std::string f = value.substr(at, end - at);
      at = end + 1;
      return f;
    };
    const std::string pid = field();
    p.identity = field();
    p.layout_identity = field();
    const bool complete = at <= value.size();
    p.note = complete ? field() : std::string();
    p.cpus = at <= value.size() ? field() : std::string();
    char* end = nullptr;
    p.pid = std::strtoll(pid.c_str(), &end, 10);
    if (!complete || pid.empty() || *end != '\0' || p.identity.empty()) {
      throw error(errc::store, "store key '" + key + "' does not hold where a ddp rank runs ('" + value + "')", {.rank = rank});
    }
    return p;
  }

  int rank_ = 0;
  std::vector<rank_place> places_;
  rank_numbering numbering_;
};

}  // namespace ddp
