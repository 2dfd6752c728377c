#pragma once
// ddp::detail::function_ref<R(Args...)>: a non-owning reference to a callable, two pointers,
// no allocation. It lets a large function take "any callable" without being a template: the
// function is then compiled once instead of once per lambda type that reaches it. The
// referenced callable must outlive every call (a temporary lives to the end of the full
// expression, which is long enough for a call argument).

#include <memory>
#include <type_traits>
#include <utility>

namespace ddp::detail {

template <class Signature>
class function_ref;

template <class R, class... Args>
class function_ref<R(Args...)> {
 public:
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, function_ref> && std::is_invocable_r_v<R, F&, Args...>)
  function_ref(F&& f) noexcept  // NOLINT(google-explicit-constructor): used like a function parameter
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* o, Args... args) -> R {
          auto& callable = *static_cast<std::remove_reference_t<F>*>(o);
          if constexpr (std::is_void_v<R>) callable(std::forward<Args>(args)...);
          else return callable(std::forward<Args>(args)...);
        }) {}

  R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  void* object_;
  R (*call_)(void*, Args...);
};

}  // namespace ddp::detail
