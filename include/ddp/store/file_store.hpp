#pragma once
// file_store: a store over one file shared by the processes of one host (like torch's FileStore).
//
// How it stays atomic across processes: the file is an append-only log of records. Every
// operation takes flock() on the file (shared to read, exclusive to write), replays the records
// appended since this object last looked (the replayed map is cached with its file offset),
// applies the operation and appends at most one record with pwrite(). add() and compare_set()
// read and append under the same exclusive lock, so they are atomic against every process.
// Why a log and not a rewritten file: a writer that dies mid-append leaves only a truncated tail,
// which readers ignore and the next writer cuts off; nothing already written is ever damaged.
//
// Record (little endian): u8 kind (1 set, 2 erase) | u32 key bytes | u64 value bytes | key | value.
//
// get() and wait() re-check with poll() pauses growing from 1 ms to 20 ms until the deadline
// (no busy spin, no inotify dependency). The file only grows (rendezvous traffic is small);
// remove it when the job is over (options::remove_on_destroy, or whoever created the path).
// A file_store used across fork() reopens its file in the child: flock() locks belong to the open
// file description, which parent and child would otherwise share.

#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "ddp/core/reduce_op.hpp"  // detail::wrapping_plus: add() wraps like the sum op
#include "ddp/store/detail/bytes.hpp"
#include "ddp/store/store.hpp"

namespace ddp::store {

class file_store final : public store {
 public:
  struct options {
    std::chrono::milliseconds timeout = default_timeout();
    bool remove_on_destroy = false;  // unlink the file in the destructor (the last user should)
  };

  explicit file_store(std::string path) : file_store(std::move(path), options{}) {}
  file_store(std::string path, options opts) : path_(std::move(path)), remove_on_destroy_(opts.remove_on_destroy) {
    set_timeout(opts.timeout);
    open_file();
  }
  file_store(const file_store&) = delete;
  file_store& operator=(const file_store&) = delete;
  ~file_store() override {
    if (fd_ >= 0) ::close(fd_);
    if (remove_on_destroy_ && owner_pid_ == ::getpid()) ::unlink(path_.c_str());
  }

  const std::string& path() const noexcept { return path_; }

  void set(const std::string& key, std::span<const std::byte> value) override {
    check_key(key);
    check_value(value);
    std::lock_guard guard(mutex_);
    file_lock lock(*this, LOCK_EX, "store.set");
    refresh("store.set");
    append(record_set, key, value, "store.set");
  }

  std::vector<std::byte> get(const std::string& key) override {
    check_key(key);
    std::vector<std::byte> out;
    wait_for({key}, timeout(), "store.get", [&] { out = data_.at(key); });
    return out;
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    check_key(key);
    std::lock_guard guard(mutex_);
    file_lock lock(*this, LOCK_EX, "store.add");
    refresh("store.add");
    const auto it = data_.find(key);
    const std::int64_t result = ddp::detail::wrapping_plus(it == data_.end() ? std::int64_t{0} : parse_counter(it->second, key), delta);
    const auto text = std::to_string(result);
    append(record_set, key, std::as_bytes(std::span(text.data(), text.size())), "store.add");
    return result;
  }

  std::vector<std::byte> compare_set(const std::string& key, std::span<const std::byte> expected,
                                     std::span<const std::byte> desired) override {
    check_key(key);
    check_value(desired);
    std::lock_guard guard(mutex_);
    file_lock lock(*this, LOCK_EX, "store.compare_set");
    refresh("store.compare_set");
    const auto it = data_.find(key);
    const bool missing = it == data_.end();
    if (missing && !expected.empty()) return std::vector<std::byte>(expected.begin(), expected.end());
    if (missing || std::equal(it->second.begin(), it->second.end(), expected.begin(), expected.end())) {
      append(record_set, key, desired, "store.compare_set");
      return std::vector<std::byte>(desired.begin(), desired.end());
    }
    return it->second;
  }

  using store::wait;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    for (const auto& k : keys) check_key(k);
    wait_for(keys, timeout, "store.wait", [] {});
  }

  bool erase(const std::string& key) override {
    check_key(key);
    std::lock_guard guard(mutex_);
    file_lock lock(*this, LOCK_EX, "store.erase");
    refresh("store.erase");
    if (!data_.contains(key)) return false;
    append(record_erase, key, {}, "store.erase");
    return true;
  }

  std::int64_t num_keys() override {
    std::lock_guard guard(mutex_);
    file_lock lock(*this, LOCK_SH, "store.num_keys");
    refresh("store.num_keys");
    return static_cast<std::int64_t>(data_.size());
  }

 private:
  static constexpr std::uint8_t record_set = 1;
  static constexpr std::uint8_t record_erase = 2;
  static constexpr std::size_t header_bytes = 1 + 4 + 8;

  // flock() for the scope of one operation; released on every path (exceptions included).
  class file_lock {
   public:
    file_lock(file_store& s, int how, const char* op) : fd_(s.fd()) {
      while (::flock(fd_, how) != 0) {
        if (errno != EINTR) throw error(errc::store, system_message("flock(" + s.path_ + ")"), {.op = op});
      }
    }
    ~file_lock() { ::flock(fd_, LOCK_UN); }
    file_lock(const file_lock&) = delete;
    file_lock& operator=(const file_lock&) = delete;

   private:
    int fd_;
  };

  void open_file() {
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd_ < 0) throw error(errc::config, system_message("file_store: cannot open '" + path_ + "'"));
    owner_pid_ = ::getpid();
    data_.clear();
    offset_ = 0;
    valid_end_ = 0;
  }

  // The fd of this process: a forked child must not share the parent's lock (see the header).
  int fd() {
    if (owner_pid_ != ::getpid()) {
      ::close(fd_);
      open_file();
    }
    return fd_;
  }

  // Replays records appended since the last look. Caller holds the file lock.
  void refresh(const char* op) {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) throw error(errc::store, system_message("fstat(" + path_ + ")"), {.op = op});
    const auto size = static_cast<std::uint64_t>(st.st_size);
    if (size < valid_end_) {  // the file was truncated or replaced behind our back: start over
      data_.clear();
      offset_ = valid_end_ = 0;
    }
    if (size == offset_) return;
    std::vector<std::byte> buf(size - valid_end_);
    read_at(buf, valid_end_, op);
    std::size_t at = 0;
    while (buf.size() - at >= header_bytes) {
      const auto kind = std::to_integer<std::uint8_t>(buf[at]);
      const auto klen = detail::get_le<std::uint32_t>(&buf[at + 1]);
      const auto vlen = detail::get_le<std::uint64_t>(&buf[at + 5]);
      if ((kind != record_set && kind != record_erase) || klen == 0 || klen > max_key_bytes || vlen > max_value_bytes) {
        throw error(errc::store, "file_store '" + path_ + "' is corrupt at byte " + std::to_string(valid_end_ + at) +
                                     " (not written by ddp::store::file_store?); remove it and restart the job",
                    {.op = op});
      }
      if (buf.size() - at - header_bytes < klen + vlen) break;  // a writer died mid-record
      const auto* p = buf.data() + at + header_bytes;
      std::string key(reinterpret_cast<const char*>(p), klen);
      if (kind == record_set) data_[std::move(key)].assign(p + klen, p + klen + vlen);
      else data_.erase(key);
      at += header_bytes + klen + vlen;
    }
    valid_end_ += at;
    offset_ = size;
  }

  // Caller holds the exclusive lock and has called refresh().
  void append(std::uint8_t kind, const std::string& key, std::span<const std::byte> value, const char* op) {
    if (offset_ != valid_end_) {  // cut off the truncated tail of a writer that died
      if (::ftruncate(fd_, static_cast<off_t>(valid_end_)) != 0)
        throw error(errc::store, system_message("ftruncate(" + path_ + ")"), {.op = op});
      offset_ = valid_end_;
    }
    std::vector<std::byte> rec;
    rec.reserve(header_bytes + key.size() + value.size());
    detail::put_le(rec, kind);
    detail::put_le(rec, static_cast<std::uint32_t>(key.size()));
    detail::put_le(rec, static_cast<std::uint64_t>(value.size()));
    detail::put_bytes(rec, key);
    detail::put_bytes(rec, value);
    std::size_t done = 0;
    while (done < rec.size()) {
      const ssize_t n = ::pwrite(fd_, rec.data() + done, rec.size() - done, static_cast<off_t>(valid_end_ + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw error(errc::store, system_message("write(" + path_ + ")"), {.op = op});
      done += static_cast<std::size_t>(n);
    }
    valid_end_ += rec.size();
    offset_ = valid_end_;
    if (kind == record_set) data_[key].assign(value.begin(), value.end());
    else data_.erase(key);
  }

  void read_at(std::vector<std::byte>& buf, std::uint64_t from, const char* op) {
    std::size_t done = 0;
    while (done < buf.size()) {
      const ssize_t n = ::pread(fd_, buf.data() + done, buf.size() - done, static_cast<off_t>(from + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw error(errc::store, system_message("read(" + path_ + ")"), {.op = op});
      if (n == 0) break;
      done += static_cast<std::size_t>(n);
    }
    buf.resize(done);
  }

  // Re-checks under a shared lock until every key exists, then runs `found` under that lock.
  template <class F>
  void wait_for(const std::vector<std::string>& keys, std::chrono::milliseconds timeout, const char* op, F&& found) {
    const auto until = deadline::after(timeout);
    int pause_ms = 1;
    while (true) {
      {
        std::lock_guard guard(mutex_);
        file_lock lock(*this, LOCK_SH, op);
        refresh(op);
        std::vector<std::string> missing;
        for (const auto& k : keys)
          if (!data_.contains(k)) missing.push_back(k);
        if (missing.empty()) {
          found();
          return;
        }
        if (until.expired()) {
          throw error(errc::timeout,
                      "keys " + detail::quote_keys(missing) + " not set within " + std::to_string(timeout.count()) + " ms",
                      {.op = op});
        }
      }
      ::poll(nullptr, 0, std::min(pause_ms, until.poll_timeout_ms() < 0 ? pause_ms : until.poll_timeout_ms()));
      pause_ms = std::min(pause_ms * 2, 20);
    }
  }

  std::string path_;
  bool remove_on_destroy_ = false;
  int fd_ = -1;
  pid_t owner_pid_ = -1;
  std::mutex mutex_;  // flock() does not exclude threads sharing one fd
  std::map<std::string, std::vector<std::byte>, std::less<>> data_;
  std::uint64_t offset_ = 0;     // file size at the last refresh
  std::uint64_t valid_end_ = 0;  // end of the last complete record
};

static_assert(key_value_store<file_store>);

}  // namespace ddp::store
