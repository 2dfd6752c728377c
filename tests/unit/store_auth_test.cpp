// tcp_store authentication by default: the per-user secret (made once, race-free, 0600, refused
// when unsafe), the token derived from it, what happens without one, and the SHA-256/HMAC checked
// against OpenSSL's.
#include <dirent.h>
#include <dlfcn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ddp/store/detail/hmac_sha256.hpp"
#include "ddp/store/detail/secret.hpp"
#include "ddp/store/tcp_store.hpp"
#include "support/log_capture.hpp"
#include "support/loopback_listener.hpp"
#include "support/multiprocess.hpp"

namespace ddp_test_store_auth {

using namespace std::chrono_literals;
namespace ds = ddp::store::detail;
using ddp::store::tcp_store;
using ddp::store::tcp_store_server;

namespace {

// Sets (or with nullopt unsets) an environment variable for a scope.
struct scoped_env {
  std::string name;
  std::optional<std::string> old;
  scoped_env(std::string n, const std::optional<std::string>& value) : name(std::move(n)) {
    if (const char* v = std::getenv(name.c_str())) old = v;
    if (value) ::setenv(name.c_str(), value->c_str(), 1);
    else ::unsetenv(name.c_str());
  }
  ~scoped_env() {
    if (old) ::setenv(name.c_str(), old->c_str(), 1);
    else ::unsetenv(name.c_str());
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;
};

struct temp_dir {
  std::string path;
  temp_dir() {
    char buf[] = "/tmp/ddp-auth-test-XXXXXX";
    REQUIRE(::mkdtemp(buf) != nullptr);
    path = buf;
  }
  ~temp_dir() { (void)std::system(("rm -rf '" + path + "'").c_str()); }
  std::vector<std::string> entries(const std::string& sub) const {
    std::vector<std::string> out;
    if (DIR* d = ::opendir((path + "/" + sub).c_str())) {
      while (const dirent* e = ::readdir(d))
        if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") out.emplace_back(e->d_name);
      ::closedir(d);
    }
    return out;
  }
};

using ddp::test::log_capture;

}  // namespace

TEST_CASE("store secret: made on first use with mode 0600, then read back the same; the token is HMAC(secret, context | job)") {
  temp_dir home;
  const std::string path = home.path + "/cfg/ddp/secret";
  std::string why;
  const auto first = ds::load_or_create_secret(path, why);
  REQUIRE(first.has_value());
  struct stat st{};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  CHECK(st.st_size == 32);
  REQUIRE(::stat((home.path + "/cfg/ddp").c_str(), &st) == 0);
  CHECK((st.st_mode & 0077) == 0);  // the directory made for it is private too
  const auto second = ds::load_or_create_secret(path, why);
  REQUIRE(second.has_value());
  CHECK(*first == *second);
  CHECK(home.entries("cfg/ddp") == std::vector<std::string>{"secret"});  // no temporary left behind

  // Reference: the HMAC spelled out over the documented message.
  std::vector<std::byte> msg;
  ds::put_bytes(msg, std::string_view("ddp-store-token"));
  msg.push_back(std::byte{0});
  ds::put_bytes(msg, std::string_view("slurm:7.0"));
  CHECK(ds::derive_token(*first, "slurm:7.0") == ds::to_hex(ds::hmac_sha256(*first, msg)));
  CHECK(ds::derive_token(*first, "slurm:7.0").size() == 64);
  CHECK(ds::derive_token(*first, "slurm:7.0") != ds::derive_token(*first, "slurm:8.0"));
}

TEST_CASE("store secret: 8 processes starting at once agree on one secret, 20 rounds") {
  // One reader's open can fail just before another process links the secret: the window is
  // narrow, so one round rarely lands in it and the rounds make it likely.
  for (int round = 0; round < 20; ++round) {
    temp_dir home;
    const std::string path = home.path + "/ddp/secret";
    int go[2];
    REQUIRE(::pipe(go) == 0);
    constexpr int n = 8;
    std::vector<int> outs(n);
    std::vector<pid_t> pids;
    for (int i = 0; i < n; ++i) {
      int out[2];
      REQUIRE(::pipe(out) == 0);
      const pid_t pid = ::fork();
      REQUIRE(pid >= 0);
      if (pid == 0) {
        ::close(go[1]);
        char c;
        (void)::read(go[0], &c, 1);  // every child blocks here until the parent closes the pipe
        std::string why, text;
        try {
          const auto s = ds::load_or_create_secret(path, why);
          text = s ? ds::to_hex(*s) : "none: " + why;
        } catch (const std::exception& e) {
          text = std::string("error: ") + e.what();
        }
        (void)::write(out[1], text.data(), text.size());
        ::_exit(0);
      }
      ::close(out[1]);
      outs[static_cast<std::size_t>(i)] = out[0];
      pids.push_back(pid);
    }
    ::close(go[0]);
    ::close(go[1]);  // start them all
    std::vector<std::string> seen;
    for (const int fd : outs) {
      std::string text;
      char buf[256];
      ssize_t got;
      while ((got = ::read(fd, buf, sizeof buf)) > 0) text.append(buf, static_cast<std::size_t>(got));
      ::close(fd);
      seen.push_back(text);
    }
    for (const pid_t pid : pids) ::waitpid(pid, nullptr, 0);
    INFO("round " << round << ", first: " << seen[0]);
    REQUIRE(seen[0].size() == 64);
    for (const auto& s : seen) REQUIRE(s == seen[0]);
    REQUIRE(home.entries("ddp") == std::vector<std::string>{"secret"});
  }
}

TEST_CASE("store secret: one that others may read, or of another owner, or damaged, is refused with errc::config") {
  temp_dir home;
  const std::string path = home.path + "/ddp/secret";
  std::string why;
  REQUIRE(ds::load_or_create_secret(path, why).has_value());
  auto refused = [&](const std::string& fragment) {
    try {
      ds::load_or_create_secret(path, why);
      FAIL("used an unsafe secret");
    } catch (const ddp::error& e) {
      CHECK(e.code() == ddp::errc::config);
      CHECK_THAT(e.what(), Catch::Contains(path) && Catch::Contains(fragment));
    }
  };
  REQUIRE(::chmod(path.c_str(), 0644) == 0);
  refused("has mode 0644: others may read it; chmod 600");
  REQUIRE(::chmod(path.c_str(), 0640) == 0);
  refused("has mode 0640");
  REQUIRE(::chmod(path.c_str(), 0600) == 0);
  if (::geteuid() == 0) {
    REQUIRE(::chown(path.c_str(), 12345, 12345) == 0);
    refused("belongs to uid 12345, not to this user");
    REQUIRE(::chown(path.c_str(), 0, 0) == 0);
  } else {
    WARN("SKIPPED (part): a secret of another owner needs root to make (chown)");
  }
  REQUIRE(::truncate(path.c_str(), 5) == 0);
  refused("is 5 bytes, expected 32");
  REQUIRE(::unlink(path.c_str()) == 0);
  REQUIRE(::symlink("/etc/hostname", path.c_str()) == 0);
  refused("symbolic link");
}

TEST_CASE("store secret: the path follows XDG_CONFIG_HOME, else HOME, else the passwd entry") {
  {
    scoped_env xdg("XDG_CONFIG_HOME", "/x/cfg");
    CHECK(ds::secret_path() == "/x/cfg/ddp/secret");
  }
  scoped_env xdg("XDG_CONFIG_HOME", std::nullopt);
  {
    scoped_env home("HOME", "/x/home");
    CHECK(ds::secret_path() == "/x/home/.config/ddp/secret");
  }
  scoped_env home("HOME", std::nullopt);
  const passwd* pw = ::getpwuid(::geteuid());
  if (pw != nullptr && pw->pw_dir != nullptr && pw->pw_dir[0] == '/') CHECK(ds::secret_path() == std::string(pw->pw_dir) + "/.config/ddp/secret");
  else WARN("SKIPPED (part): this user has no passwd entry with a home");
}

TEST_CASE("tcp_store: authentication is on by default, from the per-user secret and the job identity") {
  temp_dir home;
  scoped_env xdg("XDG_CONFIG_HOME", home.path);
  scoped_env token("DDP_STORE_TOKEN", std::nullopt);
  scoped_env auth("DDP_STORE_AUTH", std::nullopt);
  log_capture log;
  tcp_store_server server({.port = 0, .log = log.sink(), .job = "slurm:9.0"});
  tcp_store rank({.port = server.port(), .timeout = 5s, .job = "slurm:9.0"});
  rank.set_string("k", "v");
  CHECK(rank.get_string("k") == "v");
  CHECK(log.all().empty());  // nothing to say when authentication is on

  // The same secret and job from a forked rank: what ranks of one job on one host do.
  const auto r = ddp::test::run_ranks(2, [&](int) {
    tcp_store other({.port = server.port(), .timeout = 5s, .job = "slurm:9.0"});
    ddp::test::check(other.get_string("k") == "v", "a forked rank reads the key");
  });
  INFO(r.describe());
  CHECK(r.ok());

  // A client without authentication, or with a token of its own, gets nothing.
  try {
    tcp_store open({.port = server.port(), .timeout = 5s, .token = std::string(), .job = "slurm:9.0"});
    FAIL("a client without a token got in");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::store);
    CHECK_THAT(e.what(), Catch::Contains("wrong or missing DDP_STORE_TOKEN") && Catch::Contains("options::token is empty"));
  }
  CHECK_THROWS_AS(tcp_store({.port = server.port(), .timeout = 5s, .token = std::string("guess"), .job = "slurm:9.0"}), ddp::error);
  CHECK(rank.num_keys() == 1);
  CHECK(log.all().find(ds::derive_token(*ds::read_secret(home.path + "/ddp/secret"), "slurm:9.0")) == std::string::npos);
}

TEST_CASE("tcp_store: DDP_STORE_AUTH=off, or a secret that cannot be made, turns authentication off with one line") {
  scoped_env token("DDP_STORE_TOKEN", std::nullopt);
  {
    scoped_env auth("DDP_STORE_AUTH", "off");
    log_capture log;
    tcp_store_server server({.port = 0, .log = log.sink()});
    tcp_store c({.port = server.port(), .timeout = 5s});
    c.set_string("k", "v");
    CHECK(log.all() == "authentication is off (DDP_STORE_AUTH=off): any local process can read and write this store\n");
    CHECK_THROWS_AS(tcp_store_server({.host = "0.0.0.0", .port = 0, .log = log.sink()}), ddp::error);
  }
  {
    scoped_env auth("DDP_STORE_AUTH", "maybe");
    CHECK_THROWS_WITH(tcp_store_server({.port = 0}), Catch::Contains("DDP_STORE_AUTH='maybe' (expected on or off)"));
  }
  {  // a home that cannot hold the secret (as if read-only): the job still runs, and says why
    scoped_env auth("DDP_STORE_AUTH", std::nullopt);
    scoped_env xdg("XDG_CONFIG_HOME", "/dev/null/cfg");
    log_capture log;
    tcp_store_server server({.port = 0, .log = log.sink()});
    tcp_store c({.port = server.port(), .timeout = 5s});
    c.set_string("k", "v");
    CHECK(c.get_string("k") == "v");
    const std::string lines = log.all();
    CHECK_THAT(lines, Catch::StartsWith("authentication is off (cannot create the store secret /dev/null/cfg/ddp/secret: mkdir"));
    CHECK(std::count(lines.begin(), lines.end(), '\n') == 1);
  }
  {  // an empty DDP_STORE_TOKEN is unset, not "off"
    temp_dir home;
    scoped_env xdg("XDG_CONFIG_HOME", home.path);
    scoped_env empty("DDP_STORE_TOKEN", "");
    log_capture log;
    tcp_store_server server({.port = 0, .log = log.sink()});
    tcp_store c({.port = server.port(), .timeout = 5s});
    CHECK(log.all().empty());
    CHECK_THROWS_AS(tcp_store({.port = server.port(), .timeout = 5s, .token = std::string()}), ddp::error);
  }
}

TEST_CASE("tcp_store: a derived token may listen on all interfaces") {
  temp_dir home;
  scoped_env xdg("XDG_CONFIG_HOME", home.path);
  scoped_env token("DDP_STORE_TOKEN", std::nullopt);
  scoped_env auth("DDP_STORE_AUTH", std::nullopt);
  tcp_store_server server({.host = "0.0.0.0", .port = 0});
  tcp_store c({.port = server.port(), .timeout = 5s});
  c.set_string("k", "v");
  CHECK(c.get_string("k") == "v");
}

// ---- our SHA-256/HMAC against OpenSSL's ----------------------------------------------------

TEST_CASE("sha256 and hmac_sha256 equal OpenSSL's on random keys and messages of every length up to 300 bytes") {
  void* lib = ::dlopen("libcrypto.so.3", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) lib = ::dlopen("libcrypto.so", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    WARN("SKIPPED: OpenSSL's libcrypto is not installed (apt-get install libssl3), so there is nothing to compare with");
    return;
  }
  using sha256_fn = unsigned char* (*)(const unsigned char*, std::size_t, unsigned char*);
  using evp_fn = const void* (*)();
  using hmac_fn = unsigned char* (*)(const void*, const void*, int, const unsigned char*, std::size_t, unsigned char*, unsigned int*);
  const auto sha = reinterpret_cast<sha256_fn>(::dlsym(lib, "SHA256"));
  const auto evp = reinterpret_cast<evp_fn>(::dlsym(lib, "EVP_sha256"));
  const auto hmac = reinterpret_cast<hmac_fn>(::dlsym(lib, "HMAC"));
  if (sha == nullptr || evp == nullptr || hmac == nullptr) {
    ::dlclose(lib);
    WARN("SKIPPED: this libcrypto lacks SHA256/EVP_sha256/HMAC");
    return;
  }
  std::mt19937 rng(2024);
  int compared = 0;
  for (std::size_t len = 0; len <= 300; ++len) {
    std::vector<std::byte> msg(len), key(rng() % 200);
    for (auto& b : msg) b = static_cast<std::byte>(rng());
    for (auto& b : key) b = static_cast<std::byte>(rng());
    ds::digest ref{};
    sha(reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), reinterpret_cast<unsigned char*>(ref.data()));
    REQUIRE(ds::sha256_of(msg) == ref);
    unsigned int n = 0;
    hmac(evp(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(msg.data()), msg.size(),
         reinterpret_cast<unsigned char*>(ref.data()), &n);
    REQUIRE(n == 32);
    REQUIRE(ds::hmac_sha256(key, msg) == ref);
    compared += 2;
  }
  std::vector<std::byte> big(1 << 20);  // across many blocks
  for (auto& b : big) b = static_cast<std::byte>(rng());
  ds::digest ref{};
  sha(reinterpret_cast<const unsigned char*>(big.data()), big.size(), reinterpret_cast<unsigned char*>(ref.data()));
  CHECK(ds::sha256_of(big) == ref);
  ::dlclose(lib);
  WARN("sha256/hmac_sha256: " << compared + 1 << " digests equal to OpenSSL's");
}

}  // namespace ddp_test_store_auth

// ---- mutual authentication ----------------------------------------------------------------

namespace ddp_test_store_auth {

namespace {

// A listener on a free port that plays a server which does not know the token: it answers a
// client's hello with `reply` and records every byte the client sends until it hangs up.
struct impostor {
  ddp::test::loopback_listener listener;
  std::uint16_t port = listener.port;
  std::vector<std::byte> received;
  std::thread thread;
  explicit impostor(std::vector<std::byte> reply) {
    thread = std::thread([this, reply = std::move(reply)] {
      ds::unique_fd c(::accept4(listener.fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!c) return;
      std::vector<std::byte> hello(ds::client_hello_bytes);
      if (ds::recv_exact_by(c.get(), hello, ddp::deadline::after(5s)).status != ds::transfer_status::done) return;
      received = hello;
      (void)ds::send_all_by(c.get(), reply, ddp::deadline::after(5s));
      std::byte buf[4096];
      const auto until = ddp::deadline::after(5s);
      while (ds::poll_one(c.get(), POLLIN, until) != 0) {
        const ssize_t n = ::recv(c.get(), buf, sizeof buf, MSG_DONTWAIT);
        if (n <= 0) break;
        received.insert(received.end(), buf, buf + n);
      }
    });
  }
  ~impostor() {
    if (thread.joinable()) thread.join();
  }
};

}  // namespace

TEST_CASE("tcp_store: a server that cannot prove it knows the token learns nothing but a nonce") {
  const std::string where_prefix = "the store at 127.0.0.1:";
  ds::nonce n{};
  ds::random_bytes(n);
  const ds::digest made_up{};
  for (const bool claims_token : {true, false}) {
    impostor fake(ds::encode_server_hello(claims_token, n, made_up, "slurm:5.0"));
    try {
      tcp_store c({.port = fake.port, .timeout = 5s, .token = std::string("the-job-token"), .job = "slurm:5.0"});
      FAIL("the client accepted a server without its token");
    } catch (const ddp::error& e) {
      CHECK(e.code() == ddp::errc::store);
      CHECK_THAT(e.what(), Catch::Contains(where_prefix + std::to_string(fake.port) +
                                           " does not know this job's token: another job or a stranger holds the port"));
      CHECK_THAT(e.what(), !Catch::Contains("the-job-token"));
    }
    fake.thread.join();
    // The client's hello (magic, version, its nonce) and nothing after it: no proof, no job.
    CHECK(fake.received.size() == ds::client_hello_bytes);
    const std::string all(reinterpret_cast<const char*>(fake.received.data()), fake.received.size());
    CHECK(all.find("slurm:5.0") == std::string::npos);
  }
}

TEST_CASE("tcp_store: a server of protocol version 2 is named as such by a client of this version") {
  std::vector<std::byte> v2_hello;
  ds::put_le(v2_hello, ds::protocol_magic);
  ds::put_le(v2_hello, std::uint16_t{2});
  v2_hello.resize(ds::version_notice_bytes, std::byte{0});
  impostor old(v2_hello);
  CHECK_THROWS_WITH(tcp_store({.port = old.port, .timeout = 5s, .token = std::string("t")}),
                    Catch::Contains("speaks protocol version 2, this client " + std::to_string(ddp::store::detail::protocol_version) + " (mixed ddp versions?)"));
}

}  // namespace ddp_test_store_auth
