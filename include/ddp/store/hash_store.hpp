#pragma once
// hash_store: an in-process store for ranks that are threads of one process (tests,
// single-process simulations). Thread-safe; get()/wait() block on a condition variable.

#include <condition_variable>
#include <map>
#include <mutex>

#include "ddp/core/reduce_op.hpp"  // detail::wrapping_plus: add() wraps like the sum op
#include "ddp/store/store.hpp"

namespace ddp::store {

class hash_store final : public store {
 public:
  void set(const std::string& key, std::span<const std::byte> value) override {
    check_key(key);
    check_value(value);
    {
      std::lock_guard lock(mutex_);
      data_[key].assign(value.begin(), value.end());
    }
    changed_.notify_all();
  }

  std::vector<std::byte> get(const std::string& key) override {
    check_key(key);
    std::unique_lock lock(mutex_);
    wait_locked(lock, {key}, timeout(), "store.get");
    return data_.at(key);
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    check_key(key);
    std::int64_t result = 0;
    {
      std::lock_guard lock(mutex_);
      auto& value = data_[key];
      result = ddp::detail::wrapping_plus(parse_counter(value, key), delta);
      value = to_bytes(std::to_string(result));
    }
    changed_.notify_all();
    return result;
  }

  std::vector<std::byte> compare_set(const std::string& key, std::span<const std::byte> expected,
                                     std::span<const std::byte> desired) override {
    check_key(key);
    check_value(desired);
    std::vector<std::byte> result;
    {
      std::lock_guard lock(mutex_);
      auto it = data_.find(key);
      if (it == data_.end()) {
        if (!expected.empty()) return std::vector<std::byte>(expected.begin(), expected.end());
        it = data_.emplace(key, std::vector<std::byte>(desired.begin(), desired.end())).first;
      } else if (std::equal(it->second.begin(), it->second.end(), expected.begin(), expected.end())) {
        it->second.assign(desired.begin(), desired.end());
      }
      result = it->second;
    }
    changed_.notify_all();
    return result;
  }

  using store::wait;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mutex_);
    wait_locked(lock, keys, timeout, "store.wait");
  }

  bool erase(const std::string& key) override {
    std::lock_guard lock(mutex_);
    return data_.erase(key) > 0;
  }

  std::int64_t num_keys() override {
    std::lock_guard lock(mutex_);
    return static_cast<std::int64_t>(data_.size());
  }

 private:
  void wait_locked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                   std::chrono::milliseconds timeout, const char* op) {
    const auto until = deadline::after(timeout);
    auto all_present = [&] {
      for (const auto& k : keys)
        if (!data_.contains(k)) return false;
      return true;
    };
    while (!all_present()) {
      if (until.is_never()) {
        changed_.wait(lock);
      } else if (changed_.wait_until(lock, until.time_point()) == std::cv_status::timeout && !all_present()) {
        std::string missing;
        for (const auto& k : keys)
          if (!data_.contains(k)) missing += (missing.empty() ? "'" : ", '") + k + "'";
        throw error(errc::timeout, "keys " + missing + " not set within " + std::to_string(timeout.count()) + " ms",
                    {.op = op});
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::vector<std::byte>, std::less<>> data_;
};

static_assert(key_value_store<hash_store>);

}  // namespace ddp::store
