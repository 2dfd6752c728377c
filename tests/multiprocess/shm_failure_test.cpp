// shm_communicator failure behaviour with forked ranks: a SIGKILLed peer is errc::peer_lost naming
// it on every survivor within 2 s (measured), with nothing left in /dev/shm; mismatched calls are
// errc::mismatch on every rank; deadlines are errc::timeout; abort() unblocks; no descriptor leaks.
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ddp/backends/ring/shm_communicator.hpp"
#include "ddp/store/file_store.hpp"
#include "ddp/store/hash_store.hpp"
#include "ddp/backends/ring/transport/shm.hpp"
#include "support/leaks.hpp"
#include "support/multiprocess.hpp"

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_shm_failure {

using ddp::test::shm_entries;
using ddp::test::open_fds;
using namespace std::chrono_literals;
using ddp::collective;
using comm_t = ddp::algo::shm_communicator;
using ddp::test::check;

namespace {

std::int64_t now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(ddp::clock::now().time_since_epoch()).count(); }

ddp::collective_desc make_desc(std::uint64_t seq, collective op, ddp::dtype t, std::size_t count, int root = -1) {
  ddp::collective_desc d;
  d.seq = seq;
  d.op = op;
  d.type = t;
  d.count = count;
  d.root = root;
  return d;
}

struct group_run {
  ddp::test::run_result result;
  std::vector<std::string> leftovers;  // /dev/shm entries of the job after every rank ended
};

// fn(rank, comm, store) on p forked ranks; the store is shared so ranks can tell each other things.
template <class Fn>
group_run run_group(int p, const std::string& name, Fn fn, std::chrono::milliseconds timeout = 60s) {
  static int counter = 0;
  const std::string tag = name + std::to_string(::getpid()) + "x" + std::to_string(++counter);
  const std::string path = "/tmp/ddp-" + tag + ".store";
  ::unlink(path.c_str());
  group_run out;
  out.result = ddp::test::run_ranks(
      p,
      [&](int rank) {
        ddp::store::file_store st(path);
        comm_t comm(st, tag + "/", rank, p, ddp::deadline::after(30s));
        fn(rank, comm, st);
      },
      timeout);
  ::unlink(path.c_str());
  out.leftovers = shm_entries(tag + "_");
  return out;
}

// Expects fn to throw ddp::error with `code` whose message contains every one of `needles`.
template <class Fn>
ddp::error expect_error(ddp::errc code, std::vector<std::string> needles, Fn fn) {
  try {
    fn();
  } catch (const ddp::error& e) {
    check(e.code() == code, std::string("wrong error code ") + std::string(ddp::to_string(e.code())) + ": " + e.what());
    for (const auto& n : needles) check(std::string(e.what()).find(n) != std::string::npos, "'" + n + "' not in: " + e.what());
    return e;
  }
  throw std::runtime_error("no error was raised");
}

void report_latency(ddp::store::file_store& st, int rank) {
  const auto killed = std::stoll(st.get_string("killed_at"));
  const double ms = static_cast<double>(now_ns() - killed) / 1e6;
  std::printf("rank %d noticed the dead peer after %.1f ms\n", rank, ms);
  check(ms < 2000, "noticed after " + std::to_string(ms) + " ms");
}

}  // namespace

TEST_CASE("shm failure: a peer SIGKILLed before a collective is peer_lost on every survivor, named, within 2 s") {
  const int p = 3;
  for (bool large : {false, true}) {
    const auto run = run_group(p, "shmkill", [&](int rank, comm_t& comm, ddp::store::file_store& st) {
      const std::size_t n = large ? (1 << 20) : 4;
      std::vector<float> data(n, 1.0f);
      comm.all_reduce(std::span<float>(data), ddp::sum{}, make_desc(1, collective::all_reduce, ddp::dtype::float32, n), ddp::deadline::after(20s));
      if (rank == 2) {
        // Dies once the others are through call 1 (else they could see the abort inside it).
        st.wait({"through0", "through1"}, 20s);
        st.set_string("killed_at", std::to_string(now_ns()));
        ::raise(SIGKILL);
      }
      st.set_string("through" + std::to_string(rank), "1");
      expect_error(ddp::errc::peer_lost, {"peer rank 2", "pid", "exited"}, [&] {
        comm.all_reduce(std::span<float>(data), ddp::sum{}, make_desc(2, collective::all_reduce, ddp::dtype::float32, n), ddp::deadline::after(20s));
      });
      report_latency(st, rank);
      // The communicator stays failed.
      expect_error(ddp::errc::peer_lost, {"earlier call"}, [&] { comm.barrier(make_desc(3, collective::barrier, ddp::dtype::uint8, 0), ddp::deadline::after(1s)); });
    });
    INFO(run.result.describe());
    CHECK(run.result.ranks[0].ok());
    CHECK(run.result.ranks[1].ok());
    CHECK(run.result.ranks[2].signal == SIGKILL);
    CHECK(run.leftovers.empty());
    WARN(run.result.ranks[0].output << run.result.ranks[1].output);
  }
}

TEST_CASE("shm failure: a peer SIGKILLed in the middle of large collectives (user and group buffers)") {
  for (bool group : {false, true}) {
    const int p = 3;
    const auto run = run_group(p, "shmkillmid", [&](int rank, comm_t& comm, ddp::store::file_store& st) {
      const std::size_t n = 4 << 20;  // 16 MiB of float32: many staged chunks per call
      ddp::shared_buffer<float> shared;
      std::vector<float> own;
      std::span<float> data;
      if (group) {
        shared = comm.allocate<float>(n, ddp::deadline::after(20s));
        data = shared.span();
      } else {
        own.resize(n);
        data = own;
      }
      std::atomic<int> calls{0};
      std::thread killer;
      if (rank == 1) {
        // Dies while its main thread is inside a collective (the third or later).
        killer = std::thread([&] {
          while (calls.load() < 3) std::this_thread::yield();
          st.set_string("killed_at", std::to_string(now_ns()));
          ::raise(SIGKILL);
        });
      }
      try {
        for (std::uint64_t seq = 1; seq < 100000; ++seq) {
          calls = static_cast<int>(seq);
          comm.all_reduce(data, ddp::sum{}, make_desc(seq, collective::all_reduce, ddp::dtype::float32, n), ddp::deadline::after(20s));
        }
        throw std::runtime_error("the collectives never failed");
      } catch (const ddp::error& e) {
        check(rank != 1, "the killed rank got an error");
        check(e.code() == ddp::errc::peer_lost, std::string("wrong code: ") + e.what());
        check(std::string(e.what()).find("peer rank 1") != std::string::npos, std::string("dead rank not named: ") + e.what());
        report_latency(st, rank);
      }
      if (killer.joinable()) killer.join();
    });
    INFO((group ? "group" : "user") << "\n" << run.result.describe());
    CHECK(run.result.ranks[0].ok());
    CHECK(run.result.ranks[2].ok());
    CHECK(run.result.ranks[1].signal == SIGKILL);
    CHECK(run.leftovers.empty());
    WARN(run.result.ranks[0].output << run.result.ranks[2].output);
  }
}

TEST_CASE("shm failure: mismatched collectives are errc::mismatch on every rank, describing both calls") {
  SECTION("different ops, small") {
    const auto run = run_group(3, "shmmis", [](int rank, comm_t& comm, ddp::store::file_store&) {
      std::vector<float> data(16, 1.0f);
      expect_error(ddp::errc::mismatch, {"mismatched collectives", "all_reduce #5", "broadcast #5"}, [&] {
        if (rank == 1) comm.broadcast(std::span<float>(data), 0, make_desc(5, collective::broadcast, ddp::dtype::float32, 16, 0), ddp::deadline::after(10s));
        else comm.all_reduce(std::span<float>(data), ddp::sum{}, make_desc(5, collective::all_reduce, ddp::dtype::float32, 16), ddp::deadline::after(10s));
      });
    });
    INFO(run.result.describe());
    CHECK(run.result.ok());
    CHECK(run.leftovers.empty());
  }
  SECTION("different counts and dtypes, large, nothing written") {
    const auto run = run_group(2, "shmmis2", [](int rank, comm_t& comm, ddp::store::file_store&) {
      const std::size_t n = 100000 + static_cast<std::size_t>(rank);
      std::vector<float> data(n, static_cast<float>(rank + 1));
      expect_error(ddp::errc::mismatch, {"float32 x 100000", "float32 x 100001"}, [&] {
        comm.all_reduce(std::span<float>(data), ddp::sum{}, make_desc(1, collective::all_reduce, ddp::dtype::float32, n), ddp::deadline::after(10s));
      });
      for (float x : data) check(x == static_cast<float>(rank + 1), "data was modified despite the mismatch");
    });
    INFO(run.result.describe());
    CHECK(run.result.ok());
    const auto run2 = run_group(2, "shmmis3", [](int rank, comm_t& comm, ddp::store::file_store&) {
      expect_error(ddp::errc::mismatch, {"int32 x 50000", "float32 x 50000"}, [&] {
        if (rank == 0) {
          std::vector<float> data(50000);
          comm.all_reduce(std::span<float>(data), ddp::sum{}, make_desc(1, collective::all_reduce, ddp::dtype::float32, 50000), ddp::deadline::after(10s));
        } else {
          std::vector<std::int32_t> data(50000);
          comm.all_reduce(std::span<std::int32_t>(data), ddp::sum{}, make_desc(1, collective::all_reduce, ddp::dtype::int32, 50000), ddp::deadline::after(10s));
        }
      });
    });
    INFO(run2.result.describe());
    CHECK(run2.result.ok());
  }
  SECTION("send and recv of different types") {
    const auto run = run_group(2, "shmmisp2p", [](int rank, comm_t& comm, ddp::store::file_store&) {
      if (rank == 0) {
        std::vector<float> data(10);
        comm.send(std::span<const float>(data), 1, make_desc(1, collective::send, ddp::dtype::float32, 10), ddp::deadline::after(10s));
      } else {
        std::vector<std::int32_t> data(10);
        expect_error(ddp::errc::mismatch, {"recv (int32 x 10)", "send #1 (float32 x 10)"}, [&] {
          comm.recv(std::span<std::int32_t>(data), 0, make_desc(1, collective::recv, ddp::dtype::int32, 10), ddp::deadline::after(10s));
        });
      }
    });
    INFO(run.result.describe());
    CHECK(run.result.ok());
  }
}

TEST_CASE("shm failure: a deadline is errc::timeout on time, and the peer that comes late sees the abort") {
  const auto run = run_group(2, "shmdl", [](int rank, comm_t& comm, ddp::store::file_store& st) {
    std::vector<double> data(1000, 1.0);
    if (rank == 0) {
      const auto start = ddp::clock::now();
      expect_error(ddp::errc::timeout, {"deadline", "rank 1"}, [&] {
        comm.all_reduce(std::span<double>(data), ddp::sum{}, make_desc(1, collective::all_reduce, ddp::dtype::float64, 1000), ddp::deadline::after(300ms));
      });
      const auto took = ddp::clock::now() - start;
      std::printf("timeout after %lld ms\n", static_cast<long long>(took / 1ms));
      check(took >= 300ms && took < 2s, "timeout took " + std::to_string(took / 1ms) + " ms");
      st.set_string("timed_out", "1");
    } else {
      st.wait({"timed_out"}, 20s);
      const auto start = ddp::clock::now();
      expect_error(ddp::errc::peer_lost, {"peer rank 0", "aborted"}, [&] {
        comm.all_reduce(std::span<double>(data), ddp::sum{}, make_desc(1, collective::all_reduce, ddp::dtype::float64, 1000), ddp::deadline::after(20s));
      });
      check(ddp::clock::now() - start < 2s, "the abort was noticed late");
    }
  });
  INFO(run.result.describe());
  CHECK(run.result.ok());
  CHECK(run.leftovers.empty());
}

TEST_CASE("shm failure: abort() from another thread or another rank unblocks a waiting collective") {
  const auto run = run_group(3, "shmabort", [](int rank, comm_t& comm, ddp::store::file_store& st) {
    std::vector<float> data(1 << 18, 1.0f);
    if (rank == 2) {
      // Never joins; rank 0 aborts its own communicator from a second thread once rank 1 waits.
      st.wait({"done0", "done1"}, 20s);
      return;
    }
    std::thread aborter;
    if (rank == 0) {
      aborter = std::thread([&] {
        st.wait({"waiting1"}, 20s);
        comm.abort();
      });
    } else {
      st.set_string("waiting1", "1");
    }
    const auto start = ddp::clock::now();
    expect_error(ddp::errc::peer_lost, {"aborted"}, [&] {
      comm.all_reduce(std::span<float>(data), ddp::sum{}, make_desc(1, collective::all_reduce, ddp::dtype::float32, data.size()), ddp::deadline::after(20s));
    });
    check(ddp::clock::now() - start < 10s, "abort took too long");
    if (aborter.joinable()) aborter.join();
    st.set_string("done" + std::to_string(rank), "1");
  });
  INFO(run.result.describe());
  CHECK(run.result.ok());
  CHECK(run.leftovers.empty());
}

TEST_CASE("shm failure: a rank that fails outside a collective, with no peer here dead, makes the peers quote its cause") {
  // The set-up's failure path: a rank whose store died (its host was killed elsewhere) aborts
  // its shared memory while its peers already wait in a collective; they must name that cause,
  // not the aborting rank.
  const std::string cause = "the store server at 127.0.0.1:1 (hosted by rank 7) closed the connection";
  const auto run = run_group(2, "shmrelay", [&](int rank, comm_t& comm, ddp::store::file_store& st) {
    std::vector<float> data(1 << 16, 1.0f);
    if (rank == 1) {
      st.wait({"waiting0"}, 20s);
      comm.abort_noticing(0ms, cause);
      return;
    }
    st.set_string("waiting0", "1");
    const auto start = ddp::clock::now();
    expect_error(ddp::errc::peer_lost, {cause, "relayed by rank 1"}, [&] {
      comm.all_reduce(std::span<float>(data), ddp::sum{}, make_desc(1, collective::all_reduce, ddp::dtype::float32, data.size()), ddp::deadline::after(20s));
    });
    check(ddp::clock::now() - start < 10s, "the abort was noticed late");
  });
  INFO(run.result.describe());
  CHECK(run.result.ok());
  CHECK(run.leftovers.empty());
}

TEST_CASE("shm failure: a rank whose set-up fails says why in the store, and a peer that finds it exited quotes that") {
  // Rank 1 is played by the test: it "published" its segment as a process that has exited, as a
  // rank does that fails in set-up (another rank died) and exits before its peers map it.
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) ::_exit(0);
  REQUIRE(::waitpid(child, nullptr, 0) == child);
  char host[256] = {};
  REQUIRE(::gethostname(host, sizeof host - 1) == 0);
  const std::string tag = "shmpost" + std::to_string(::getpid());
  const auto set_up = [&](ddp::store::hash_store& st, const std::string& prefix) {
    st.set_string(prefix + "shm/t/ready/1", std::to_string(child) + " 3 " + host);
    ddp::detail::shm::shm_group group(st, prefix, "t", 0, 2, 4096, ddp::deadline::after(10s));
  };
  SECTION("rank 1 posted its cause before it exited: it is quoted first, rank 1 as its messenger") {
    ddp::store::hash_store st;
    const std::string cause = "peer rank 7 (pid 1) exited before its shared memory was mapped";
    st.set_string(tag + "/shm/t/failed/1", cause);
    const auto e = expect_error(ddp::errc::peer_lost, {cause + "; relayed by rank 1 before it exited"}, [&] { set_up(st, tag + "/"); });
    CHECK(std::string(e.what()).find("rank 7") < std::string(e.what()).find("rank 1 "));
    CHECK(st.get_string(tag + "/shm/t/failed/0") == e.message());  // and rank 0 posts what it says
  }
  SECTION("rank 1 posted nothing: its exit is the news, and rank 0 posts that") {
    ddp::store::hash_store st;
    const auto e = expect_error(ddp::errc::peer_lost, {"peer rank 1 (pid " + std::to_string(child) + ") exited before its shared memory was mapped"},
                                [&] { set_up(st, tag + "b/"); });
    CHECK(std::string(e.what()).find("relayed") == std::string::npos);
    CHECK(st.get_string(tag + "b/shm/t/failed/0") == e.message());
  }
  CHECK(shm_entries(tag).empty());
}

TEST_CASE("shm failure: a communicator with shared buffers leaves no descriptor and no segment behind") {
  const auto run = ddp::test::run_ranks(2, [](int rank) {
    const std::string path = "/tmp/ddp-shmfd-" + std::to_string(::getppid()) + ".store";
    const int before = open_fds();
    {
      ddp::store::file_store st(path);
      const int with_store = open_fds();
      {
        comm_t comm(st, "shmfd" + std::to_string(::getppid()) + "/", rank, 2, ddp::deadline::after(20s));
        auto buf = comm.allocate<float>(1 << 20, ddp::deadline::after(20s));
        for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(rank);
        comm.all_reduce(buf.span(), ddp::sum{}, make_desc(1, collective::all_reduce, ddp::dtype::float32, buf.size()), ddp::deadline::after(20s));
        check(buf[12345] == 1.0f, "wrong sum");
        comm.barrier(make_desc(2, collective::barrier, ddp::dtype::uint8, 0), ddp::deadline::after(20s));
      }
      check(open_fds() == with_store, "descriptors leaked: " + std::to_string(open_fds() - with_store));
    }
    check(open_fds() == before, "descriptors leaked after the store closed");
  });
  ::unlink(("/tmp/ddp-shmfd-" + std::to_string(::getpid()) + ".store").c_str());
  INFO(run.describe());
  CHECK(run.ok());
  CHECK(shm_entries("shmfd" + std::to_string(::getpid()) + "_").empty());
}

// Waits (up to `limit`) until process `pid` has exited; false when it is still running then.
bool exited_within(pid_t pid, std::chrono::milliseconds limit) {
  const int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) return errno == ESRCH;  // already reaped
  pollfd p{fd, POLLIN, 0};
  const int n = ::poll(&p, 1, static_cast<int>(limit.count()));
  ::close(fd);
  return n == 1;
}

TEST_CASE("shm failure: a peer that finished its part and exited is no failure for a wait on another peer") {
  // Rank 0 sends to rank 1 and exits normally; rank 2 sends to rank 1 only after rank 0 is gone, so
  // rank 1 waits on rank 2 while rank 0 is dead. Liveness is checked every 100 us (no spinning).
  const std::string path = "/tmp/ddp-shmdone-" + std::to_string(::getpid()) + ".store";
  const std::string prefix = "shmdone" + std::to_string(::getpid()) + "/";
  ::unlink(path.c_str());
  const auto run = ddp::test::run_ranks(
      3,
      [&](int rank) {
        ddp::store::file_store st(path);
        ddp::shm_transport::options opts;
        opts.ring_bytes = std::size_t{1} << 16;
        opts.wait = {.spin = 0ns, .spin_oversubscribed = 0ns, .yield = 0ns, .slice = 100us};
        ddp::shm_transport t(st, prefix, rank, 3, ddp::deadline::after(20s), opts);
        std::byte word[4] = {};
        if (rank == 0) {
          st.set_string("pid0", std::to_string(::getpid()));
          std::memcpy(word, "zero", 4);
          t.send(1, word, ddp::deadline::after(20s));
          return;
        }
        if (rank == 2) {
          st.wait({"rank1 waits on rank2"}, 20s);
          check(exited_within(static_cast<pid_t>(std::stoi(st.get_string("pid0"))), 20000ms), "rank 0 did not exit");
          std::memcpy(word, "two!", 4);
          t.send(1, word, ddp::deadline::after(20s));
          return;
        }
        t.recv(0, word, ddp::deadline::after(20s));
        check(std::memcmp(word, "zero", 4) == 0, "wrong bytes from rank 0");
        st.set_string("rank1 waits on rank2", "1");
        t.recv(2, word, ddp::deadline::after(20s));
        check(std::memcmp(word, "two!", 4) == 0, "wrong bytes from rank 2");
      },
      60s);
  ::unlink(path.c_str());
  INFO(run.describe());
  CHECK(run.ok());
  CHECK(shm_entries(prefix.substr(0, prefix.size() - 1) + "_").empty());
}

}  // namespace ddp_test_shm_failure
