#pragma once
// The per-user secret behind the tcp_store's default token: 32 random bytes in
// $XDG_CONFIG_HOME/ddp/secret (else ~/.config/ddp/secret), made on first use with mode 0600.
// The token of a job is HMAC-SHA256(secret, "ddp-store-token" | job identity), so every rank of
// one user's job derives the same token without being given one, another user cannot, and two
// jobs of one user get different tokens. Ranks on several hosts agree when their homes are shared.
//
// Creation is race-free: the bytes go to a file of a unique name first, which is then hard-linked
// to the final name; a link never replaces an existing file, so ranks starting at once all end up
// reading the one that won. A secret that others could read, or that belongs to someone else, is
// refused (errc::config) rather than used; one that cannot be made at all (read-only home, no home)
// is not an error: the caller runs without authentication and says why.

#include <fcntl.h>
#include <pwd.h>
#include <stdio.h>  // renameat2
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/core/env_registry.hpp"
#include "ddp/core/error.hpp"
#include "ddp/core/unique_fd.hpp"
#include "ddp/store/detail/hmac_sha256.hpp"

namespace ddp::store::detail {

inline constexpr std::size_t secret_bytes = 32;
inline constexpr std::string_view token_context = "ddp-store-token";

inline void random_bytes(std::span<std::byte> out) {
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::getrandom(out.data() + done, out.size() - done, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw error(errc::store, system_message("getrandom"));
    done += static_cast<std::size_t>(n);
  }
}

inline std::string to_hex(std::span<const std::byte> bytes) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s;
  s.reserve(bytes.size() * 2);
  for (const auto b : bytes) {
    s += digits[std::to_integer<unsigned>(b) >> 4];
    s += digits[std::to_integer<unsigned>(b) & 15];
  }
  return s;
}

/// Where the secret lives; "" when there is no home to put it in.
inline std::string secret_path() {
  if (const char* xdg = read_env("XDG_CONFIG_HOME"); xdg != nullptr && xdg[0] == '/') return std::string(xdg) + "/ddp/secret";
  std::string home;
  if (const char* h = read_env("HOME"); h != nullptr && h[0] == '/') {
    home = h;
  } else {
    // getpwuid_r: another thread may be using getpwuid's static buffer.
    passwd pw{};
    passwd* found = nullptr;
    std::vector<char> buf(16384);
    if (::getpwuid_r(::geteuid(), &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr && found->pw_dir != nullptr &&
        found->pw_dir[0] == '/')
      home = found->pw_dir;
  }
  if (home.empty()) return {};
  return home + "/.config/ddp/secret";
}

/// mkdir -p of the directory holding `path`, new directories 0700; errno of the failure, else 0.
inline int make_parent_dirs(const std::string& path) {
  for (std::size_t slash = path.find('/', 1); slash != std::string::npos; slash = path.find('/', slash + 1)) {
    const std::string dir = path.substr(0, slash);
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return errno;
  }
  return 0;
}

/// Reads the secret at `path`; nullopt when it does not exist. Throws errc::config when it is
/// unsafe or damaged: those need a person, and silently running without it would hide that.
inline std::optional<std::array<std::byte, secret_bytes>> read_secret(const std::string& path) {
  ddp::detail::unique_fd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) {
    const int err = errno;
    // Missing: another process may link it between this open and a later look, so the open's
    // own answer decides, and making it says why when that fails too.
    if (err == ENOENT || err == ENOTDIR) return std::nullopt;
    struct stat lst{};
    // A directory on the way that is not searchable: making it says why.
    if (::lstat(path.c_str(), &lst) != 0) return std::nullopt;
    throw error(errc::config, "cannot read the store secret " + path + ": " + system_message("open", err) +
                                  (err == ELOOP ? " (a symbolic link: make it a plain file)"
                                                : " (owner uid " + std::to_string(lst.st_uid) + ")"));
  }
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0) throw error(errc::config, "cannot read the store secret " + path + ": " + system_message("fstat"));
  if (!S_ISREG(st.st_mode)) throw error(errc::config, "the store secret " + path + " is not a regular file");
  if (st.st_uid != ::geteuid()) {
    throw error(errc::config, "the store secret " + path + " belongs to uid " + std::to_string(st.st_uid) + ", not to this user (uid " +
                                  std::to_string(::geteuid()) + "): remove it, and a new one is made");
  }
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw error(errc::config, "the store secret " + path + " has mode " + mode +
                                  ": others may read it; chmod 600 it (and make a new one if it was read: remove it)");
  }
  std::array<std::byte, secret_bytes> secret{};
  std::size_t got = 0;
  while (got < secret.size()) {
    const ssize_t n = ::read(fd.get(), secret.data() + got, secret.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  if (got != secret_bytes || st.st_size != static_cast<off_t>(secret_bytes)) {
    throw error(errc::config, "the store secret " + path + " is " + std::to_string(st.st_size) + " bytes, expected " +
                                  std::to_string(secret_bytes) + ": remove it, and a new one is made");
  }
  return secret;
}

/// Makes the secret at `path` unless it exists; errno-style message on failure, "" on success
/// (including when another process made it first).
inline std::string create_secret(const std::string& path) {
  if (const int err = make_parent_dirs(path); err != 0) return system_message("mkdir", err);
  std::array<std::byte, 8> tag{};
  random_bytes(tag);
  const std::string temp = path.substr(0, path.rfind('/') + 1) + ".secret." + std::to_string(::getpid()) + "." + to_hex(tag);
  ddp::detail::unique_fd fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd) return system_message("open", errno);
  std::array<std::byte, secret_bytes> secret{};
  random_bytes(secret);
  std::string failure;
  std::size_t done = 0;
  while (failure.empty() && done < secret.size()) {
    const ssize_t n = ::write(fd.get(), secret.data() + done, secret.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) failure = system_message("write", n < 0 ? errno : ENOSPC);
    else done += static_cast<std::size_t>(n);
  }
  // Written and on disk before it gets its name: a reader never sees a partial secret.
  if (failure.empty() && (::fchmod(fd.get(), 0600) != 0 || ::fsync(fd.get()) != 0)) failure = system_message("fsync", errno);
  fd.reset();
  if (failure.empty() && ::link(temp.c_str(), path.c_str()) != 0 && errno != EEXIST) {
    // File systems without hard links: a rename that refuses to replace is just as race-free.
    if (::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, path.c_str(), RENAME_NOREPLACE) != 0 && errno != EEXIST)
      failure = system_message("link", errno);
  }
  ::unlink(temp.c_str());
  return failure;
}

/// The secret, made on first use; nullopt with `why_not` set when it cannot be made.
inline std::optional<std::array<std::byte, secret_bytes>> load_or_create_secret(const std::string& path, std::string& why_not) {
  if (path.empty()) {
    why_not = "no home directory for the store secret (HOME and XDG_CONFIG_HOME unset, no passwd entry)";
    return std::nullopt;
  }
  if (auto s = read_secret(path)) return s;
  if (const std::string failure = create_secret(path); !failure.empty()) {
    why_not = "cannot create the store secret " + path + ": " + failure;
    return std::nullopt;
  }
  if (auto s = read_secret(path)) return s;
  why_not = "the store secret " + path + " vanished right after it was made";
  return std::nullopt;
}

/// HMAC-SHA256(secret, "ddp-store-token" | job), as hex.
inline std::string derive_token(std::span<const std::byte> secret, std::string_view job) {
  std::vector<std::byte> msg;
  const auto add = [&](std::string_view s) {
    const auto b = std::as_bytes(std::span(s.data(), s.size()));
    msg.insert(msg.end(), b.begin(), b.end());
  };
  add(token_context);
  msg.push_back(std::byte{0});  // no job identity can run into the context
  add(job);
  return to_hex(hmac_sha256(secret, msg));
}

}  // namespace ddp::store::detail
