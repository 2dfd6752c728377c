#pragma once
// detail::any_work: the one type a bucket's reduction is held as, whatever the group or the comm
// hook returned. Apart from the wrapper because comm hooks (ddp/compression.hpp) return it too.

#include <concepts>
#include <memory>
#include <type_traits>
#include <utility>

#include "ddp/core/deadline.hpp"
#include "ddp/data_parallel/waitable.hpp"
#include "ddp/work.hpp"

namespace ddp::detail {

/// A type-erased handle on anything waitable (a group's work, or a hook's own result). A
/// ddp::work is held as it is (no allocation: what every bucket's reduction returns).
class any_work {
 public:
  any_work() = default;
  any_work(work w) : direct_(std::move(w)), is_direct_(true) {}  // NOLINT: implicit on purpose
  template <waitable W>
    requires(!std::same_as<std::remove_cvref_t<W>, any_work> && !std::same_as<std::remove_cvref_t<W>, work>)
  any_work(W w) : impl_(std::make_shared<model<W>>(std::move(w))) {}  // NOLINT: implicit on purpose

  explicit operator bool() const noexcept { return is_direct_ || impl_ != nullptr; }
  void wait() {
    if (is_direct_) direct_.wait();
    else if (impl_) impl_->wait();
  }
  /// False when not done by d. Works without wait(deadline) are waited for in full (their own
  /// group timeout bounds them).
  bool wait(deadline d) {
    if (is_direct_) return direct_.wait(d);
    return impl_ ? impl_->wait_until(d) : true;
  }

 private:
  struct base {
    virtual ~base() = default;
    virtual void wait() = 0;
    virtual bool wait_until(deadline d) = 0;
  };
  template <class W>
  struct model final : base {
    explicit model(W w) : work(std::move(w)) {}
    void wait() override { work.wait(); }
    bool wait_until(deadline d) override {
      if constexpr (deadline_waitable<W>) {
        return static_cast<bool>(work.wait(d));
      } else {
        work.wait();
        return true;
      }
    }
    W work;
  };
  work direct_;
  bool is_direct_ = false;
  std::shared_ptr<base> impl_;
};

}  // namespace ddp::detail
