#pragma once
// Parameter containers: what distributed_data_parallel synchronizes.
//
// A model's parameters are listed as ddp::parameter_ref values: a name, a shape, one dtype,
// the memory space, and two contiguous spans (values and gradients) of the same length.
// The order of the list must be the same on every rank and stable across steps (it is the
// order the DDP wrapper buckets in, and the order in which shapes are checked across ranks).
//
// How a type lists its parameters (the first that applies wins):
//  1. a ddp::parameter_traits<P> specialization with `static R parameters(P&)`;
//  2. a free function `parameters(P&)` found by ADL (in the model's namespace);
//  3. the built-in adapters: std::vector<parameter_ref>; a std::pair (value, grad) of
//     tensors; any range of such pairs (std::vector<std::pair<std::vector<T>, std::vector<T>>>).
// R is a range whose elements are parameter_ref (or convertible to it) or (value, grad) pairs.
//
// A "tensor" is anything ddp::tensor_traits knows: every contiguous, sized range of a dtype
// (std::vector, std::array, std::span), and, with their adapter headers, Eigen matrices
// (ddp/adapters/eigen.hpp) and thrust vectors (ddp/adapters/thrust.hpp). Non-contiguous
// containers (std::list, std::deque) are rejected at compile time: the collectives work on
// flat memory and a gradient cannot be reduced in place in a linked list.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp/core/concepts.hpp"
#include "ddp/core/dtype.hpp"
#include "ddp/core/error.hpp"

namespace ddp {

/// One parameter: its values and gradient as raw bytes of `type`, with shape and name for messages.
struct parameter_ref {
  std::string name;                  // may be empty; messages then use the index alone
  std::vector<std::int64_t> shape;   // product == numel()
  dtype type = dtype::float32;
  memory_space memory = memory_space::host;
  std::span<std::byte> value;
  std::span<std::byte> grad;

  std::size_t numel() const noexcept { return value.size() / size_of(type); }
  std::size_t bytes() const noexcept { return value.size(); }

  /// The values / gradients as T; T must be this parameter's dtype.
  template <dtype_like T>
  std::span<T> values() const { return as<T>(value); }
  template <dtype_like T>
  std::span<T> grads() const { return as<T>(grad); }

 private:
  template <class T>
  std::span<T> as(std::span<std::byte> bytes) const {
    if (dtype_of<T> != type) {
      throw error(errc::invalid_argument, "parameter '" + name + "' holds " + std::string(to_string(type)) +
                                              ", not " + std::string(to_string(dtype_of<T>)));
    }
    return {reinterpret_cast<T*>(bytes.data()), bytes.size() / sizeof(T)};
  }
};

/// "[32, 10]"
inline std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// "parameter 3 ('fc.bias')" or "parameter 3".
inline std::string describe_parameter(std::size_t index, const std::string& name) {
  std::string s = "parameter " + std::to_string(index);
  if (!name.empty()) s += " ('" + name + "')";
  return s;
}

/// A parameter over typed spans. An empty shape means one dimension of value.size().
template <dtype_like T, std::size_t N, std::size_t M>
parameter_ref make_parameter(std::span<T, N> value, std::span<T, M> grad, std::vector<std::int64_t> shape = {},
                             std::string name = {}, memory_space memory = memory_space::host) {
  static_assert(!std::is_const_v<T>, "ddp::make_parameter: values and gradients must be writable");
  if (value.size() != grad.size()) {
    throw error(errc::invalid_argument, "parameter '" + name + "': value has " + std::to_string(value.size()) +
                                            " elements but its gradient has " + std::to_string(grad.size()));
  }
  if (shape.empty()) shape.push_back(static_cast<std::int64_t>(value.size()));
  std::int64_t product = 1;
  for (auto d : shape) product *= d;
  if (product != static_cast<std::int64_t>(value.size())) {
    throw error(errc::invalid_argument, "parameter '" + name + "': shape " + shape_string(shape) + " has " +
                                            std::to_string(product) + " elements but the value has " +
                                            std::to_string(value.size()));
  }
  return parameter_ref{std::move(name), std::move(shape), dtype_of<T>, memory,
                       std::as_writable_bytes(std::span<T>(value)), std::as_writable_bytes(std::span<T>(grad))};
}

// --- tensors -------------------------------------------------------------------------

/// What ddp knows about one array type: element type, memory space, a span over it, its shape.
/// Specialize it for your own array types; the primary template is undefined ("not a tensor").
template <class T>
struct tensor_traits;

namespace detail {
template <class R>
concept host_contiguous_array =
    std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
    dtype_like<std::remove_reference_t<std::ranges::range_reference_t<R>>> &&
    !std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<R>>>;
}  // namespace detail

/// std::vector, std::array, std::span, C arrays: contiguous, sized, writable, of a dtype.
template <detail::host_contiguous_array R>
struct tensor_traits<R> {
  using element_type = std::remove_reference_t<std::ranges::range_reference_t<R>>;
  static constexpr memory_space memory = memory_space::host;
  static std::span<element_type> span(R& r) { return {std::ranges::data(r), std::ranges::size(r)}; }
  static std::vector<std::int64_t> shape(R& r) { return {static_cast<std::int64_t>(std::ranges::size(r))}; }
};

/// A type with a tensor_traits specialization (cv/ref ignored).
template <class T>
concept tensor = requires(std::remove_cvref_t<T>& t) {
  typename tensor_traits<std::remove_cvref_t<T>>::element_type;
  { tensor_traits<std::remove_cvref_t<T>>::memory } -> std::convertible_to<memory_space>;
  tensor_traits<std::remove_cvref_t<T>>::span(t);
  { tensor_traits<std::remove_cvref_t<T>>::shape(t) } -> std::convertible_to<std::vector<std::int64_t>>;
};

template <tensor T>
using tensor_element_t = typename tensor_traits<std::remove_cvref_t<T>>::element_type;

/// A (value, grad) pair of tensors of the same element type.
template <class P>
concept tensor_pair = requires { typename std::remove_cvref_t<P>::first_type; typename std::remove_cvref_t<P>::second_type; } &&
                      tensor<typename std::remove_cvref_t<P>::first_type> &&
                      tensor<typename std::remove_cvref_t<P>::second_type> &&
                      std::same_as<tensor_element_t<typename std::remove_cvref_t<P>::first_type>,
                                   tensor_element_t<typename std::remove_cvref_t<P>::second_type>>;

/// A parameter over a (value, grad) pair of tensors; the shape is the value's.
template <tensor V, tensor G>
parameter_ref make_parameter(V& value, G& grad, std::string name = {}) {
  using vt = tensor_traits<std::remove_cvref_t<V>>;
  using gt = tensor_traits<std::remove_cvref_t<G>>;
  static_assert(std::same_as<typename vt::element_type, typename gt::element_type>,
                "ddp::make_parameter: value and gradient must have the same element type");
  static_assert(vt::memory == gt::memory, "ddp::make_parameter: value and gradient must be in the same memory space");
  return make_parameter(vt::span(value), gt::span(grad), vt::shape(value), std::move(name), vt::memory);
}

// --- containers ------------------------------------------------------------------------

/// Specialize with `static R parameters(P& model)` to make P a parameter_container without touching it.
template <class P>
struct parameter_traits;

/// Elements of a parameter list: a parameter_ref (or convertible to one), or a (value, grad) pair.
template <class E>
concept parameter_element = std::convertible_to<E, parameter_ref> || tensor_pair<E>;

namespace detail {
template <class R>
concept parameter_range = std::ranges::forward_range<R> && parameter_element<std::ranges::range_reference_t<R>>;
}  // namespace detail

/// A list of parameter_refs is a container of itself.
template <>
struct parameter_traits<std::vector<parameter_ref>> {
  static std::vector<parameter_ref>& parameters(std::vector<parameter_ref>& list) { return list; }
};

/// One (value, grad) pair of tensors is one parameter.
template <tensor_pair P>
struct parameter_traits<P> {
  static std::span<P, 1> parameters(P& pair) { return std::span<P, 1>(&pair, 1); }
};

/// A range of (value, grad) pairs: one parameter each, in the range's order.
template <std::ranges::forward_range R>
  requires tensor_pair<std::ranges::range_reference_t<R>> && (!tensor_pair<R>)
struct parameter_traits<R> {
  static R& parameters(R& range) { return range; }
};

namespace detail::parameters_cpo {

void parameters() = delete;  // hides ddp::parameters, so only ADL finds a user's function

template <class P>
concept has_traits = requires(P& p) {
  { parameter_traits<P>::parameters(p) } -> parameter_range;
};
template <class P>
concept has_adl = requires(P& p) {
  { parameters(p) } -> parameter_range;
};

template <class E>
parameter_ref to_ref(E&& e) {
  if constexpr (std::convertible_to<E, parameter_ref>) {
    return parameter_ref(std::forward<E>(e));
  } else {
    return ddp::make_parameter(e.first, e.second);
  }
}

template <class R>
std::vector<parameter_ref> collect(R&& range) {
  std::vector<parameter_ref> out;
  if constexpr (std::ranges::sized_range<R>) out.reserve(std::ranges::size(range));
  for (auto&& e : range) out.push_back(to_ref(std::forward<decltype(e)>(e)));
  return out;
}

struct fn {
  template <class P>
    requires has_traits<P> || has_adl<P>
  std::vector<parameter_ref> operator()(P& model) const {
    if constexpr (has_traits<P>) {
      return collect(parameter_traits<P>::parameters(model));
    } else {
      return collect(parameters(model));
    }
  }
};

}  // namespace detail::parameters_cpo

inline namespace cpo {
/// ddp::parameters(model): the model's parameters as parameter_refs, in its stable order.
inline constexpr detail::parameters_cpo::fn parameters{};
}  // namespace cpo

/// Something whose parameters ddp can list as (value, grad) contiguous spans of a dtype.
template <class P>
concept parameter_container = requires(P& p) {
  { ddp::parameters(p) } -> std::same_as<std::vector<parameter_ref>>;
};

}  // namespace ddp
